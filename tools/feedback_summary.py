"""The feedback study's summary table, generated from its reports (docs/results/feedback_study_*.json).

    python tools/feedback_summary.py [--results docs/results] [--write docs/results/feedback_phase.md]
                                     [--portable-paths]

Prints the table of hypotheses (each a paired difference over seeds with its 95 % t-interval, df =
seeds - 1, and a verdict) and the token multiplier's table; ``--write`` puts them between the write-up's
markers;
``--portable-paths`` rewrites the machine paths in the reports' JSON as relative ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    from fbt_megatron.research.hypotheses import (M_BEGIN, M_END, Reports, multiplier_table, portable_report,
                                                  replace_summary, summary_table)
    from fbt_megatron.files import write_text_atomic

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="docs/results")
    ap.add_argument("--write", default=None, help="the write-up to put the table in (between its markers)")
    ap.add_argument("--portable-paths", action="store_true", help="make the reports' JSON paths relative")
    a = ap.parse_args(argv)
    results = Path(a.results)
    if not results.is_dir():
        ap.error(f"--results {results}: no such folder")
    if a.portable_paths:
        for path in sorted(results.glob("feedback_study_*.json")):
            write_text_atomic(path, json.dumps(portable_report(json.loads(path.read_text())), indent=1, default=float))
    reports = Reports(results)
    text, m_text = summary_table(reports), multiplier_table(reports)
    if a.write:
        doc = Path(a.write)
        try:
            write_text_atomic(doc, replace_summary(replace_summary(doc.read_text(), text), m_text, M_BEGIN, M_END))
        except (OSError, ValueError) as e:
            ap.error(str(e))
    print(text + "\n\n" + m_text)
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "feedback_summary"))
