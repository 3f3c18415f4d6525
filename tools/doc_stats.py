"""Measure the prose of Markdown pages: size, long paragraphs, words per sentence.

    python tools/doc_stats.py [PAGE.md ...]     # default: README.md and every page under docs/

Prose only: fenced code blocks, tables, headings and HTML comments are left out, and so is everything
from a heading that starts with "Appendix" on. A list item counts as its own paragraph. Sentences end
at ". ", "! " or "? " before a capital letter, a digit or markup, or at the end of a paragraph.
Limits (docs/README.md, "Writing"): no paragraph over ``MAX_PARAGRAPH`` characters, a page's mean at
most ``MAX_MEAN_WORDS`` words a sentence. Exit 1 naming the pages over a limit.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAGRAPH = 800
MAX_MEAN_WORDS = 25.0
# Generated pages are tables and help text; their prose is the code's.
GENERATED = ("docs/reference/",)
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9`(\[*_\"])")


@dataclass
class PageStats:
    path: str
    characters: int
    paragraphs: int
    long_paragraphs: list[int]  # lengths of those over MAX_PARAGRAPH
    sentences: int
    words: int

    @property
    def mean_words(self) -> float:
        return self.words / self.sentences if self.sentences else 0.0

    @property
    def ok(self) -> bool:
        return not self.long_paragraphs and self.mean_words <= MAX_MEAN_WORDS


def prose_paragraphs(text: str) -> list[str]:
    """The page's prose paragraphs and list items, each joined onto one line."""
    paragraphs: list[str] = []
    current: list[str] = []
    in_code = False
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)

    def flush():
        if current:
            paragraphs.append(" ".join(part.strip() for part in current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            in_code = not in_code
            flush()
            continue
        if in_code:
            continue
        if stripped.startswith("#"):
            flush()
            if re.match(r"#+\s+appendix", stripped, re.IGNORECASE):
                break
            continue
        if not stripped or stripped.startswith("|"):
            flush()
            continue
        if _LIST_ITEM.match(line):
            flush()
            line = _LIST_ITEM.sub("", line, count=1)
        current.append(line)
    flush()
    return [p for p in paragraphs if p]


def page_stats(path: Path) -> PageStats:
    paragraphs = prose_paragraphs(path.read_text())
    sentences = words = 0
    for p in paragraphs:
        parts = [s for s in _SENTENCE_END.split(p) if s.strip()]
        sentences += len(parts)
        words += sum(len(s.split()) for s in parts)
    try:
        name = str(path.resolve().relative_to(ROOT))
    except ValueError:
        name = str(path)
    return PageStats(name, sum(len(p) for p in paragraphs), len(paragraphs),
                     [len(p) for p in paragraphs if len(p) > MAX_PARAGRAPH], sentences, words)


def default_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if not str(p.relative_to(ROOT)).startswith(GENERATED)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", type=Path)
    a = ap.parse_args(argv)
    stats = [page_stats(p) for p in (a.pages or default_pages())]
    print(f"| page | prose characters | paragraphs over {MAX_PARAGRAPH} (largest) | mean words per sentence |")
    print("|---|---|---|---|")
    for s in stats:
        largest = f" ({max(s.long_paragraphs)})" if s.long_paragraphs else ""
        print(f"| {s.path} | {s.characters:,} | {len(s.long_paragraphs)}{largest} | {s.mean_words:.1f} |")
    over = [s.path for s in stats if not s.ok]
    if over:
        print(f"over a limit: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
