"""Markdown tables, JSON and matplotlib figures for ``docs/results/`` (no display needed)."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from data_pipeline.output_dir import check_own_files, json_object_with
from fbt_megatron.errors import UserError, report
from fbt_megatron.files import write_text_atomic


def mean_std(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt(mean: float, std: float | None = None, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(command: str, seconds: float) -> str:
    return provenance_line(provenance_record(command, seconds))


def provenance_record(command: str, seconds: float, conditions: str = "") -> dict:
    """How a result was made, kept in its JSON so that ``--render-only`` writes the same page again.
    ``conditions``: what the numbers depend on beyond the command (a shared machine, an earlier code state)."""
    return {"command": command, "date": time.strftime("%Y-%m-%d"),
            "machine": platform.processor() or platform.machine(), "minutes": round(seconds / 60, 1),
            "conditions": conditions}


def provenance_line(record: dict) -> str:
    """The page's last line (after the recorded conditions, a paragraph of their own)."""
    line = (f"_Produced by `{record['command']}` on {record['date']} ({record['machine']}, torch CPU) "
            f"in {record['minutes']:.1f} min._")
    return (record["conditions"] + "\n\n" + line) if record.get("conditions") else line


ANSWER_HEADER = ["question", "answer", "number", "what would change it"]


def answers_table(rows: list[list[str]], number: str = "number") -> str:
    """The table a results page opens with: one row per question, computed from the page's JSON."""
    return table([*ANSWER_HEADER[:2], number, ANSWER_HEADER[3]], rows)


def load_recorded(out_dir: Path, stem: str) -> dict:
    """``out_dir/STEM.json`` as a tool wrote it; one sentence when it is missing or not a tool's report."""
    path = out_dir / f"{stem}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: run the tool once without --render-only to record it.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); restore it from git or run the tool again.") from None
    if "provenance" not in data:
        raise UserError(f"{path} has no 'provenance' record, so its page cannot be rendered again; "
                        "run the tool again to record it.")
    return data


PRODUCED_BY = "_Produced by `"


def _page_of_a_tool(file: Path) -> bool:
    lines = file.read_text(encoding="utf-8").rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(PRODUCED_BY)


def _report_of_a_tool(file: Path) -> bool:
    return json_object_with("provenance")(file) or json_object_with("args", "readouts", "val_history")(file)


def _figure_of_a_tool(file: Path) -> bool:
    """A matplotlib PNG beside the page or the report a tool wrote (a tool writes both before its figure):
    a user's own matplotlib figure of that name, alone, is not taken for a tool's."""
    with open(file, "rb") as f:
        head = f.read(4096)
    page, report = file.with_suffix(".md"), file.with_suffix(".json")
    return head.startswith(b"\x89PNG") and b"Matplotlib" in head and (
        (page.is_file() and _page_of_a_tool(page)) or (report.is_file() and _report_of_a_tool(report)))


def check_report_files(out_dir: Path, stem: str) -> None:
    """Refuse (:class:`OutputDirError`, one sentence) when ``out_dir`` holds a ``STEM.md``, ``STEM.json`` or
    ``STEM.png`` that no tool wrote: a page ending in its provenance line, a JSON report with a
    ``provenance`` record (the feedback study's: its args, read-outs and validation histories), a
    matplotlib figure beside such a page. A tool calls it before its runs, and :func:`save` again."""
    check_own_files(out_dir, {f"{stem}.md": _page_of_a_tool, f"{stem}.json": _report_of_a_tool,
                              f"{stem}.png": _figure_of_a_tool},
                    writer="a research tool", option="--out", instead="another --out")


def save(out_dir: Path, stem: str, markdown: str, data: dict, draw=None) -> Path:
    """``out_dir/STEM.{md,json}``, then ``STEM.png`` from ``draw()`` (a matplotlib figure) when given: the page and
    its JSON are written first, so a missing matplotlib loses no result. Files there that no tool wrote are
    refused first (:func:`check_report_files`)."""
    check_report_files(out_dir, stem)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / f"{stem}.md", markdown.rstrip() + "\n")
    write_text_atomic(out_dir / f"{stem}.json", json.dumps(data, indent=1, default=float))
    if draw is not None:
        fig = draw()
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=110)
    return out_dir / f"{stem}.md"


class FigureLibraryMissing(UserError, ImportError):
    """matplotlib is not installed: a tool without figures may go on (an ImportError), one that needs them
    stops with one sentence (a UserError)."""


def figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    try:
        import matplotlib
    except ImportError:
        raise FigureLibraryMissing("the figures need matplotlib: pip install -e '.[research]' "
                                   "(a tool writes its page and JSON first; --render-only draws the figure later)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def render_again(render, out_dir: Path, stem: str) -> Path:
    """``--render-only``: ``render(recorded JSON, out_dir)`` writes the page again; without matplotlib the page
    and its JSON are still written (``render`` saves them before the figure) and the old figure is kept."""
    try:
        return render(load_recorded(out_dir, stem), out_dir)
    except FigureLibraryMissing as e:
        print(f"{stem}: the page is written, its figure kept as it was: {e}", file=sys.stderr)
        return out_dir / f"{stem}.md"


def run_tool(main, prog: str, argv=None) -> int:
    """A results tool's entry point: a user error is one sentence on stderr and exit status 2."""
    try:
        return int(main(argv) or 0)
    except UserError as e:
        return report(prog, e)
