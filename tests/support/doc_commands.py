"""The `bash` blocks of the README and the task pages, as tests/integration/test_doc_commands.py runs them.

A block runs as written, in order with its page's other blocks, in one working folder per page.
A block right after an HTML comment ``<!-- doc-test: REASON -->`` needs what the CPU test machine lacks
(a GPU, a cluster, a Hugging Face model folder, vLLM): each of its commands is checked for syntax only.
An ``fbt`` command's arguments are parsed by its own parser (nothing runs); ``fbt train`` / ``fbt sft``
overrides are validated against the recipe schema; ``make TARGET`` is checked with ``make -n``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"(?:<!--\s*doc-test:\s*(?P<reason>[^>]*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```", re.DOTALL)


@dataclass
class Block:
    page: str
    line: int
    body: str
    check_only: str | None  # the reason it cannot run here, or None: it runs

    @property
    def commands(self) -> list[str]:
        """The block's commands, continuation lines joined, comments dropped."""
        joined = re.sub(r"\\\n\s*", " ", self.body)
        out = []
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
        return out


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(str(page), text[:m.start()].count("\n") + 1, m.group("body"), m.group("reason"))
            for m in _BLOCK.finditer(text)]


class _Parsed(Exception):
    pass


def _argv_of(command: str) -> list[str] | None:
    """The ``fbt`` arguments of a command line (``fbt ...``, ``.venv/bin/fbt ...``, ``torchrun ... -m
    fbt_megatron.cli ...``), or None for another program."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if Path(words[0]).name == "fbt":
        return words[1:]
    if Path(words[0]).name == "torchrun" and "fbt_megatron.cli" in words:
        return words[words.index("fbt_megatron.cli") + 1:]
    return None


def check_fbt_syntax(argv: list[str]) -> str | None:
    """Parse an ``fbt`` command line with the command's own parser, running nothing: None when it
    parses, else what is wrong."""
    from fbt_megatron import cli

    if argv and argv[0] in ("train", "sft"):
        return _check_recipe_command(argv[1:])
    originals = {name: getattr(argparse.ArgumentParser, name)
                 for name in ("parse_args", "parse_known_args", "parse_intermixed_args")}

    depth = [0]  # parse_args calls parse_known_args: stop after the outermost call, once unknown flags are refused

    def stop_after(name):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = originals[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and self.prog != "fbt":  # the top-level parser hands the rest to the command
                raise _Parsed
            return result
        return parse

    for name in originals:
        setattr(argparse.ArgumentParser, name, stop_after(name))
    try:
        code = cli.main(list(argv))
    except _Parsed:
        return None
    except SystemExit as e:
        code = e.code
    finally:
        for name, fn in originals.items():
            setattr(argparse.ArgumentParser, name, fn)
    return f"fbt {' '.join(argv)}: exited {code} before its arguments were parsed"


def _check_recipe_command(args: list[str]) -> str | None:
    from fbt_megatron.recipe import RecipeError, load_recipe

    recipe, overrides = args[0], [a for a in args[1:] if "=" in a and not a.startswith("-")]
    if not Path(recipe).exists():  # written by an earlier command of the block (from-hf): check the keys
        recipe = str(ROOT / "recipes" / "tiny.yaml")
    try:
        load_recipe(recipe, overrides)
    except (RecipeError, FileNotFoundError) as e:
        return str(e)
    return None


def check_syntax(block: Block, cwd: Path) -> list[str]:
    """What is wrong with each command of a check-only block (empty: all parse)."""
    errors = []
    for command in block.commands:
        argv = _argv_of(command)
        if argv is not None:
            result = subprocess.run([sys.executable, "-c", "import sys; from tests.support.doc_commands import "
                                     "check_fbt_syntax as c; e = c(sys.argv[1:]); print(e or ''); "
                                     "sys.exit(1 if e else 0)", *argv],
                                    cwd=cwd, capture_output=True, text=True, env=_env())
            if result.returncode:
                errors.append(f"{block.page}:{block.line}: {command}\n{result.stdout}{result.stderr[-2000:]}")
        elif command.startswith("make "):
            result = subprocess.run(["make", "-n", "-C", str(ROOT), *shlex.split(command, comments=True)[1:]],
                                    capture_output=True, text=True)
            if result.returncode:
                errors.append(f"{block.page}:{block.line}: {command}\n{result.stderr}")
    return errors


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def make_workdir(work: Path, embedded: Path) -> None:
    """A new user's folder: ``.venv/bin/{fbt,python,torchrun}`` running this interpreter, the repository's
    recipes and tools, and the embedded token mix already built."""
    bindir = work / ".venv" / "bin"
    bindir.mkdir(parents=True)
    for name, target in (("python", ""), ("fbt", "-m fbt_megatron.cli"), ("torchrun", "-m torch.distributed.run")):
        script = bindir / name
        script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {target} \"$@\"\n")
        script.chmod(0o755)
    for name in ("recipes", "tools", "fbt_megatron"):
        (work / name).symlink_to(ROOT / name)
    (work / "data").mkdir()
    (work / "data" / "embedded").symlink_to(embedded)


def run_block(block: Block, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd, capture_output=True, text=True,
                          env=_env(), timeout=timeout)
