"""Every numeric flag of every ``fbt`` command has a range (a bounded type or choices), a value outside
it is refused by one usage line (exit 2), and every number of the recipe schema has bounds too.

The parsers are found by running each command's ``main`` with argparse's parse step replaced by a
recorder, so a flag added later is walked without editing this test. ``fbt train``/``fbt sft`` take
recipe overrides (checked by the schema walk); ``fbt data``'s flags are walked by its own tests.
"""

from __future__ import annotations

import argparse
import typing

import annotated_types as at
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fbt_megatron.cli import main

NOT_ARGPARSE: set[str] = set()  # every command parses its flags with argparse (recipe overrides: the schema walk)
WALKED_ELSEWHERE: set[str] = set()
# how to reach each argparse parser: (module, argv for its main)
ENTRIES = [
    ("fbt_megatron.launch.train_cli", ["r.yaml"]),
    ("fbt_megatron.launch.sft_cli", ["r.yaml"]),
    ("data_pipeline.cli", ["inspect", "x"]),
    ("fbt_megatron.generate.cli", ["x", "--prompt", "a"]),
    ("fbt_megatron.eval.cli", ["x", "--tasks", "t"]),
    ("fbt_megatron.launch.plan", ["r.yaml", "--gpus", "1"]),
    ("fbt_megatron.launch.cli", ["submit", "r.yaml"]),
    ("fbt_megatron.launch.cli", ["submit-prepare"]),
    ("fbt_megatron.launch.cli", ["status", "x"]),
    ("fbt_megatron.launch.health", ["--run-dir", "x"]),
    ("fbt_megatron.hf.cli", ["to-hf", "a", "b"]),
    ("fbt_megatron.checkpoint.cli", ["verify", "x"]),
    ("fbt_megatron.demo", []),
]


class _Captured(Exception):
    pass


def _parser_of(module: str, argv: list[str], monkeypatch) -> argparse.ArgumentParser:
    import importlib

    got = []

    def record(self, *a, **k):
        got.append(self)
        raise _Captured

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", record)
        m.setattr(argparse.ArgumentParser, "parse_intermixed_args", record)
        with pytest.raises(_Captured):
            importlib.import_module(module).main(argv)
    return got[0]


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def unbounded_numeric_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Options of ``parser`` (and its sub-parsers) that take a number without a range."""
    bad = []
    for p in _all_parsers(parser):
        for action in p._actions:
            if action.nargs == 0 or action.choices is not None or isinstance(action, argparse._SubParsersAction):
                continue  # flags, choices, sub-commands
            numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            numeric_type = action.type in (int, float)
            bounded = hasattr(action.type, "bounds")
            if (numeric_type or numeric_default) and not bounded:
                bad.append(f"{p.prog} {'/'.join(action.option_strings) or action.dest}")
    return bad


def test_every_command_is_walked():
    from fbt_megatron.cli import COMMANDS

    walked = {m for m, _ in ENTRIES}
    for name, (module, _) in COMMANDS.items():
        assert name in NOT_ARGPARSE | WALKED_ELSEWHERE or module in walked, f"fbt {name} is not walked"


@pytest.mark.parametrize("module,argv", ENTRIES, ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_every_numeric_flag_has_a_range(module, argv, monkeypatch):
    parser = _parser_of(module, argv, monkeypatch)
    assert unbounded_numeric_flags(parser) == []


def test_the_walk_finds_an_unbounded_flag():
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--n", type=int)
    p.add_argument("--x", default=0.5)
    sub = p.add_subparsers().add_parser("s", prog="t s")
    sub.add_argument("--k", type=float)
    sub.add_argument("--mode", type=int, choices=[1, 2])
    assert unbounded_numeric_flags(p) == ["t --n", "t --x", "t s --k"]


REFUSED = [
    (["generate", "run", "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens", ">= 1"),
    (["generate", "run", "--prompt", "a", "--top-p", "1.5"], "--top-p", "<= 1"),
    (["generate", "run", "--prompt", "a", "--temperature", "-0.1"], "--temperature", ">= 0"),
    (["generate", "run", "--prompt", "a", "--temperature", "nan"], "--temperature", "must be a number >= 0 (got nan)"),
    (["eval", "run", "--tasks", "t", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["eval", "run", "--tasks", "t", "--limit", "-3"], "--limit", "> 0"),
    (["plan", "recipes/tiny.yaml", "--gpus", "0"], "--gpus", ">= 1"),
    (["plan", "recipes/tiny.yaml", "--gpus", "8", "--mfu", "1.2"], "--mfu", "<= 1"),
    (["slurm", "submit", "recipes/tiny.yaml", "--nodes", "0"], "--nodes", ">= 1"),
    (["slurm", "submit-prepare", "--array", "2", "--input", "a", "--tokenizer", "t", "--out", "o",
      "--shard-mb", "-1"], "--shard-mb", "> 0"),
    (["slurm", "submit-prepare", "--array", "2", "--input", "a", "--tokenizer", "t", "--out", "o",
      "--workers", "0"], "--workers", ">= 1"),
    (["convert", "to-hf", "ck", "out", "--max-shard-size", "0"], "--max-shard-size", "> 0"),
    (["demo", "--seq", "1"], "--seq", ">= 2"),
]


@pytest.mark.parametrize("argv,flag,bound", REFUSED, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_out_of_range_values_are_refused_in_one_line(argv, flag, bound, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and bound in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- the recipe schema
LIST_CHECKED = {"schedule.mix", "eval.passes"}  # lists of numbers: checked by a validator (tested below)


def _numeric(ann) -> bool:
    return ann in (int, float) or any(_numeric(a) for a in typing.get_args(ann) if a is not type(None))


def unbounded_recipe_numbers(model: type[BaseModel], prefix: str = "") -> list[str]:
    bad = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sections = [a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            for section in sections:
                bad += unbounded_recipe_numbers(section, f"{prefix}{name}.")
            continue
        if typing.get_origin(ann) is typing.Literal or f"{prefix}{name}" in LIST_CHECKED or not _numeric(ann):
            continue
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        inner = [m for a in args for m in getattr(a, "__metadata__", ())]  # tuple[Annotated[float, ...], ...]
        inner = [x for m in inner for x in (m.metadata if isinstance(m, FieldInfo) else [m])]
        if not any(isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le, at.Interval)) for m in [*field.metadata, *inner]):
            bad.append(f"{prefix}{name}")
    return bad


def test_every_recipe_number_has_bounds():
    from fbt_megatron.recipe import Recipe

    assert unbounded_recipe_numbers(Recipe) == []


@pytest.mark.parametrize("override,key", [
    ("train.steps=0", "train.steps"), ("optimizer.lr=0", "optimizer.lr"), ("optimizer.lr=-1e-3", "optimizer.lr"),
    ("optimizer.betas=[1.0,0.9]", "optimizer.betas.0"), ("model.ffn_hidden_size=0", "model.ffn_hidden_size"),
    ("seed=-1", "seed"), ("schedule.mix=[-0.5,1.5]", "schedule.mix"), ("eval.passes=[0]", "eval.passes"),
    ("batch.micro_batch_size=0", "batch.micro_batch_size"),
])
def test_recipe_values_out_of_range_are_refused_by_key(override, key):
    from fbt_megatron.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError) as e:
        load_recipe("recipes/tiny.yaml", [override])
    assert f"'{key}'" in str(e.value)
