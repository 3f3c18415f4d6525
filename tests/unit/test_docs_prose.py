"""The docs a user reads stay readable (tools/doc_stats.py) and hold no path of the machine they were
written on."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("doc_stats", ROOT / "tools" / "doc_stats.py")
doc_stats = sys.modules.setdefault("doc_stats", importlib.util.module_from_spec(SPEC))
SPEC.loader.exec_module(doc_stats)
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users|scratch)/[\w.-]")


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_page_meets_the_prose_limits():
    over = [f"{s.path}: paragraphs over {doc_stats.MAX_PARAGRAPH} {s.long_paragraphs}, "
            f"{s.mean_words:.1f} words a sentence" for s in map(doc_stats.page_stats, doc_stats.default_pages())
            if not s.ok]
    assert not over, "\n".join(over)


def test_the_measure_counts_what_it_says():
    sentence = "This sentence has exactly seven words here. "
    page = ROOT / "README.md"
    text = f"# Title\n\n{sentence * 3}\n\n```bash\n{'x ' * 900}\n```\n\n| table | {'y ' * 900} |\n\n- {'z' * 801}\n"
    tmp = doc_stats.prose_paragraphs(text)
    assert tmp[0].count("seven") == 3 and len(tmp) == 2 and len(tmp[1]) == 801
    assert page.exists()


def test_no_machine_paths_in_docs():
    found = []
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.is_file() and path.suffix in {".md", ".json", ".yaml", ".txt"}:
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if MACHINE_PATH.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "\n".join(found[:40])


def orphan_table_rows(text: str) -> list[int]:
    """Line numbers of table rows that start a table without its header separator (``|---|``): rows cut off
    from their table by a blank line render as plain text. Code blocks are skipped."""
    lines, out, fenced = text.splitlines(), [], False
    for n, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|") or (n and lines[n - 1].startswith("|")):
            continue
        if n + 1 >= len(lines) or not re.match(r"^\|\s*:?-{3,}", lines[n + 1]):
            out.append(n + 1)
    return out


def test_every_table_has_its_header():
    assert orphan_table_rows("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n") == [5]
    assert orphan_table_rows("```\n| not a table |\n```\n| h |\n| --- |\n") == []
    found = [f"{p.relative_to(ROOT)}:{n}" for p in doc_stats.default_pages() for n in orphan_table_rows(p.read_text())]
    assert not found, found
