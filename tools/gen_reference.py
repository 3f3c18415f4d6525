"""Generate the reference pages from the code: every recipe key and every ``fbt`` command.

    python tools/gen_reference.py           # rewrite docs/reference/recipe.md and docs/reference/cli.md
    python tools/gen_reference.py --check   # exit 1 naming each page that differs from the code

The recipe page is built from the pydantic schema (type, default, allowed values and the field's
``description``), so a key's meaning is written once, on the field. The command page is each parser's
own ``--help`` text. tests/unit/test_reference_docs.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
RECIPE_PAGE = ROOT / "docs" / "reference" / "recipe.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
# The help text is wrapped to the terminal's width; fix it so the page does not depend on who runs this.
HELP_COLUMNS = "100"
# argparse's help wording changes across Python minor versions; the committed page is this version's.
CLI_PYTHON = (3, 11)


# ----------------------------------------------------------------------------- recipe keys
def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or as ``Model | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a constrained type reads as its type (a field's description states bounds inside it)
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        kinds = {type(a).__name__ for a in typing.get_args(annotation)}
        return kinds.pop() if len(kinds) == 1 else "literal"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        name = " | ".join(_type_name(a) for a in args)
        return f"{name} or null" if len(args) < len(typing.get_args(annotation)) else name
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation) if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    return str(annotation)


def _schema_extra(field) -> dict:
    """The field's ``json_schema_extra`` when it is a dict (``allowed``, ``default_shown``), else empty."""
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _allowed(field) -> str:
    """Allowed values: a Literal's choices, a validator's list, or the numeric bounds."""
    for ann in (field.annotation, *typing.get_args(field.annotation)):
        if typing.get_origin(ann) is typing.Literal:
            return ", ".join(f"`{a}`" for a in typing.get_args(ann))
    extra = _schema_extra(field)
    if "allowed" in extra:
        return ", ".join(f"`{a}`" for a in extra["allowed"])
    bounds = []
    for m in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >=")):
            value = getattr(m, attr, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return ", ".join(bounds)


def _default(field) -> str:
    extra = _schema_extra(field)
    if "default_shown" in extra:  # a default filled from another key
        return extra["default_shown"]
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return ""
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str, missing: list[str]):
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_of(field.annotation)
        if sub is not None:  # a section, or a list of them (``key[].field``)
            listed = typing.get_origin(field.annotation) is list
            yield from _rows(sub, f"{key}[]." if listed else f"{key}.", missing)
            continue
        if not field.description:
            missing.append(key)
        yield (key, _type_name(field.annotation), _default(field), _allowed(field), field.description or "")


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def recipe_reference() -> tuple[str, list[str]]:
    """The recipe page's text, and the keys whose field has no description."""
    from data_pipeline.config import DataConfig
    from fbt_megatron.recipe import Recipe

    missing: list[str] = []
    out = ["# Recipe keys", "",
           "Every key of a training recipe, generated from the schema by `python tools/gen_reference.py`.",
           "Set a key in the recipe's YAML, or on the command line as `section.key=value`.",
           "An unknown key, or a value outside its allowed values, is refused before anything starts.", ""]
    top = [(n, f) for n, f in Recipe.model_fields.items() if _model_of(f.annotation) is None]
    sections = [(n, f) for n, f in Recipe.model_fields.items() if _model_of(f.annotation) is not None]

    def table(rows):
        lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        lines += [f"| `{k}` | {_cell(t)} | {_cell(d)} | {_cell(a)} | {_cell(m)} |" for k, t, d, a, m in rows]
        return lines + [""]

    out += ["## Top level", ""]
    rows = []
    for name, field in top:
        if not field.description:
            missing.append(name)
        rows.append((name, _type_name(field.annotation), _default(field), _allowed(field), field.description or ""))
    out += table(rows)
    for name, field in sections:
        model = _model_of(field.annotation)
        out += [f"## {name}", ""]
        intro = _first_paragraph(model.__doc__)
        if intro:
            out += [intro, ""]
        out += table(_rows(model, f"{name}.", missing))
        if name == "data":
            out += ["### data.pipeline", "", _first_paragraph(DataConfig.__doc__)
                    + " `seq_length` comes from `data.seq_length`.", ""]
            rows = [(k, t, "always `data.seq_length`" if k == "data.pipeline.seq_length" else d, a, m)
                    for k, t, d, a, m in _rows(DataConfig, "data.pipeline.", missing)]
            out += table(rows)
    return "\n".join(out).rstrip() + "\n", missing


# ----------------------------------------------------------------------------- commands
def _help_text(argv: list[str]) -> str:
    from fbt_megatron import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    return buf.getvalue().rstrip()


def _subcommands(help_text: str) -> list[str]:
    """An argparse sub-parser's choices (its positional ``{a,b}`` line), or a hand-written
    ``fbt CMD a|b`` first line."""
    match = re.search(r"^  \{([a-z0-9_,-]+)\}", help_text, re.MULTILINE)
    if match:
        return match.group(1).split(",")
    match = re.match(r"``fbt \S+ ([a-z0-9-]+(?:\|[a-z0-9-]+)+)``", help_text)
    return match.group(1).split("|") if match else []


def cli_reference() -> str:
    from fbt_megatron.cli import COMMANDS

    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "PYTHON_COLORS")}
    os.environ.update(COLUMNS=HELP_COLUMNS, NO_COLOR="1", PYTHON_COLORS="0")
    try:
        out = ["# Commands", "",
               "Every `fbt` command and flag, generated from the parsers by `python tools/gen_reference.py`",
               f"(help text as Python {CLI_PYTHON[0]}.{CLI_PYTHON[1]} prints it).", "",
               "```text", _help_text(["--help"]), "```", ""]
        for name in COMMANDS:
            text = _help_text([name, "--help"])
            out += [f"## fbt {name}", "", "```text", text, "```", ""]
            for sub in _subcommands(text):
                out += [f"### fbt {name} {sub}", "", "```text", _help_text([name, sub, "--help"]), "```", ""]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "\n".join(out).rstrip() + "\n"


def stale_pages() -> list[str]:
    """The reference pages whose committed text differs from what the code generates now."""
    stale = []
    pages = [(RECIPE_PAGE, recipe_reference()[0])]
    if sys.version_info[:2] == CLI_PYTHON:
        pages.append((CLI_PAGE, cli_reference()))
    for path, text in pages:
        if not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed pages; write nothing")
    a = ap.parse_args(argv)
    text, missing = recipe_reference()
    if missing:
        print(f"gen_reference: recipe keys without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    if a.check:
        stale = stale_pages()
        if stale:
            print(f"gen_reference: out of date: {', '.join(stale)}; run python tools/gen_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    RECIPE_PAGE.parent.mkdir(parents=True, exist_ok=True)
    RECIPE_PAGE.write_text(text)
    if sys.version_info[:2] == CLI_PYTHON:
        CLI_PAGE.write_text(cli_reference())
    else:
        print(f"gen_reference: {CLI_PAGE.name} is written with Python {CLI_PYTHON[0]}.{CLI_PYTHON[1]} only",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
