"""The embedded default token mix: built offline on any machine from material that is always there.

Sources:

* ``code``  — the Python standard library's own ``.py`` source (tests, ``site-packages`` and
  ``pydoc_data`` excluded), files in a seeded order up to ``code_mb`` megabytes.
* ``prose`` — English text shipped with Python: the reference-manual topics in ``pydoc_data.topics``
  and the module/class/function docstrings of the standard library (parsed with ``ast``).
* ``math``  — generated arithmetic and word problems with worked answers (GSM8K-style ``#### answer``),
  from a seeded generator.

``build_embedded(out)`` trains a sentencepiece tokenizer on a sample of all three, writes one dataset
directory per source and ``mix.yaml`` (the loader's ``data:`` section; a recipe's ``data.pipeline``). It is idempotent: a build with
the same settings is detected by ``embedded.json`` and kept, also when another Python's standard library made it
(``force`` rebuilds it from this one's): a second Python sharing the checkout does not rewrite data a run reads.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import yaml

from fbt_megatron.files import TEMPORARY, write_text_atomic

from .output_dir import earlier_output
from .prepare import prepare_dataset
from .shards import INDEX_FILE
from .tokenizer import train_tokenizer, tokenizer_hash

BUILD_VERSION = 2  # 2: index format version 2 (memory-mapped arrays), mix.yaml states token shares
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "pydoc_data", "__pycache__",
                "turtledemo", "lib2to3"}
# Share of *tokens* per source, written into mix.yaml as the weights (data.pipeline.weight_by: tokens).
TOKEN_SHARES = {"code": 0.4, "prose": 0.3, "math": 0.3}
# what a build writes into its directory: only a directory holding these (and embedded.json) is built over
EMBEDDED_ENTRIES = ("embedded.json", "mix.yaml", TEMPORARY, "tokenizer.model", "tokenizer.model.tmp", ".*.replaced-*",
                    *(f"{n}{suffix}" for n in TOKEN_SHARES for suffix in ("", ".tmp", ".lock")))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for r, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDE_DIRS and not d.startswith("plat-"))
        files.extend(Path(r) / n for n in sorted(names) if n.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no Python standard library sources under {root}")
    return files


def _rel(f: Path) -> str:
    return str(f.relative_to(sysconfig.get_paths()["stdlib"]))


def code_documents(files: list[Path], max_bytes: int, seed: int):
    order = sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{_rel(f)}".encode()).hexdigest())
    total = 0
    for f in order:
        if total >= max_bytes:
            break
        text = f.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield f"stdlib/{_rel(f)}", text


def prose_documents(files: list[Path], max_bytes: int):
    import pydoc_data.topics as topics

    total = 0
    for key in sorted(topics.topics):
        text = topics.topics[key].strip()
        if text:
            total += len(text)
            yield f"pydoc_topics/{key}", text
    for f in files:
        if total >= max_bytes:
            break
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    title = "" if isinstance(node, ast.Module) else f"{node.name}\n\n"
                    parts.append(title + doc)
        if parts:
            text = "\n\n".join(parts)
            total += len(text)
            yield f"docstrings/{_rel(f)}", text


# ------------------------------------------------------------------------------------------- math
NAMES = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pavel", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "shells", "cards", "coins", "stamps"]


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice("+-*/")
    if op == "+":
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.\n#### {a + b}"
    if op == "-":
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}.\n#### {a - b}"
    if op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        t, o = divmod(b, 10)
        steps = f"{a} * {b} = {a} * {t * 10} + {a} * {o} = {a * t * 10} + {a * o} = {a * b}."
        return f"Compute {a} * {b}.", f"{steps}\n#### {a * b}"
    q, d = rng.randint(2, 99), rng.randint(2, 40)
    n = q * d
    return f"What is {n} / {d}?", f"{d} * {q} = {n}, so {n} / {d} = {q}.\n#### {q}"


def _word(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    x, y = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    if kind == 0:
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(1, 20)
        c = min(c, a + b)
        q = f"{x} has {a} {it}. {y} gives {x} {b} more, and then {x} gives away {c}. How many {it} does {x} have now?"
        ans = (f"{x} starts with {a} {it}. After getting {b} more, {x} has {a} + {b} = {a + b}. "
               f"After giving away {c}, {x} has {a + b} - {c} = {a + b - c}.\n#### {a + b - c}")
    elif kind == 1:
        n, p = rng.randint(2, 12), rng.randint(2, 25)
        q = f"{x} buys {n} boxes of {it}. Each box costs {p} dollars. How much does {x} spend?"
        ans = f"Each box costs {p} dollars, so {n} boxes cost {n} * {p} = {n * p} dollars.\n#### {n * p}"
    elif kind == 2:
        per, k = rng.randint(2, 15), rng.randint(2, 12)
        total = per * k
        q = f"{x} shares {total} {it} equally among {k} friends. How many {it} does each friend get?"
        ans = f"Each friend gets {total} / {k} = {per} {it}.\n#### {per}"
    elif kind == 3:
        price, pct = rng.randint(2, 40) * 10, rng.choice([10, 20, 25, 30, 50])
        off = price * pct // 100
        q = f"A jacket costs {price} dollars. It is on sale for {pct}% off. What is the sale price?"
        ans = (f"The discount is {pct}% of {price} = {price} * {pct} / 100 = {off} dollars. "
               f"The sale price is {price} - {off} = {price - off} dollars.\n#### {price - off}")
    else:
        a, b = rng.randint(2, 9), rng.randint(1, 50)
        xv = rng.randint(-20, 30)
        c = a * xv + b
        q = f"Solve for x: {a}x + {b} = {c}."
        ans = f"Subtract {b} from both sides: {a}x = {c} - {b} = {c - b}. Divide by {a}: x = {c - b} / {a} = {xv}.\n#### {xv}"
    return q, ans


def math_documents(n: int, seed: int):
    rng = random.Random(seed)
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 4)):  # a document holds 1-4 worked problems
            q, a = (_word if rng.random() < 0.6 else _arith)(rng)
            parts.append(f"Question: {q}\nAnswer: {a}")
        yield f"math/{i:07d}", "\n\n".join(parts)


# ------------------------------------------------------------------------------------------ build
VOCAB_SIZE = 4096  # the tokenizer's vocabulary of a default build


def embedded_section(out: str | os.PathLike, *, seq_length: int = 256, seed: int = 0) -> dict:
    """The ``data:`` section of the mix built under ``out`` (what :func:`build_embedded` returns), known
    before it is built: a run is planned without building it."""
    out = Path(out)
    return {
        "tokenizer": str(out / "tokenizer.model"),
        "seq_length": seq_length,
        "seed": seed,
        "num_workers": 0,
        "weight_by": "tokens",
        "sources": [{"name": n, "path": str(out / n), "weight": TOKEN_SHARES[n]} for n in TOKEN_SHARES],
    }


def _point_mix_here(out: Path, log) -> None:
    """Point a build's ``mix.yaml`` at the build's own files where it names, by absolute paths, the same
    files in another folder (the build was copied or moved), keeping its other keys: it would read the
    old folder. Relative paths, paths a user changed and a file that does not parse are left as they are."""
    mix = out / "mix.yaml"
    try:
        text = mix.read_text()
        raw = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        log(f"{mix} could not be read; left as it is (--force rebuilds it)")
        return
    section = raw.get("data") if isinstance(raw, dict) else None
    listed = section.get("sources") if isinstance(section, dict) else None
    if not isinstance(listed, list):
        return  # not the layout a build writes
    sources = [s for s in listed if isinstance(s, dict)]
    named = {"tokenizer.model": section.get("tokenizer"), **{str(s.get("name")): s.get("path") for s in sources}}
    if set(named) != {"tokenizer.model", *TOKEN_SHARES} \
            or not all(isinstance(p, str) and os.path.isabs(p) and Path(p).name == n for n, p in named.items()):
        return  # not the layout a build writes
    folders = {Path(p).parent for p in named.values()}
    home = out.resolve()
    if len(folders) != 1 or (old := folders.pop()).resolve() == home:
        return
    section["tokenizer"] = str(home / "tokenizer.model")
    for s in sources:
        s["path"] = str(home / s["name"])
    try:
        _rewrite_mix(mix, text, raw)
    except OSError as e:
        log(f"could not point {mix} at {home} ({e.strerror}); it still names the files in {old}")
        return
    log(f"{mix} named the files in {old}; it now names those in {home} (the build was copied or moved)")


def _rewrite_mix(mix: Path, text: str, raw: dict) -> None:
    """Write ``raw`` over ``mix`` (whose text was ``text``), keeping its leading comment lines."""
    header = "".join(itertools.takewhile(lambda line: line.startswith("#"), text.splitlines(keepends=True)))
    # a reader sees the old file or the new one; two callers at once each write their own temporary
    write_text_atomic(mix, header + yaml.safe_dump(raw, sort_keys=False))


def settle_mix_seq_length(out: str | os.PathLike, seq_length: int | None, log=print) -> int | None:
    """The ``seq_length`` of the build's ``mix.yaml`` after this call: set to ``seq_length`` where asked and
    different (said), else the file's own (an earlier build's, or one you edited), kept. The section
    ``fbt data embedded`` prints must be the file's. None: a file that does not parse or lacks the key, left."""
    mix = Path(out) / "mix.yaml"
    try:
        text = mix.read_text()
        raw = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # build_embedded has said so
    section = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(section, dict) or "seq_length" not in section:
        return None  # not the layout a build writes
    was = section["seq_length"]
    if seq_length is None or was == seq_length:
        return was
    section["seq_length"] = seq_length
    try:
        _rewrite_mix(mix, text, raw)
    except OSError as e:
        log(f"could not set seq_length in {mix} ({e.strerror}); it keeps seq_length {was}")
        return was
    log(f"{mix} had seq_length {was}; it now has seq_length {seq_length} (as asked)")
    return seq_length


def build_embedded(out: str | os.PathLike, *, vocab_size: int = VOCAB_SIZE, code_mb: float = 6.0,
                   prose_mb: float = 3.0, math_docs: int = 20_000, seed: int = 0,
                   num_workers: int | None = None, seq_length: int = 256, force: bool = False,
                   progress: bool = True, log=print) -> dict:
    """Build (or find already built) the embedded mix under ``out``. Returns the ``data:`` section.
    ``out`` must be absent, empty or an earlier build's (``embedded.json``): anything else is refused
    (:class:`output_dir.OutputDirError`), nothing written."""
    out = Path(out)
    corpus = {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"]}  # what the text is read from
    settings = {"version": BUILD_VERSION, "vocab_size": vocab_size, "code_mb": code_mb, "prose_mb": prose_mb,
                "math_docs": math_docs, "seed": seed, **corpus}
    stamp = out / "embedded.json"
    earlier_output(out, markers=(stamp.name,), patterns=EMBEDDED_ENTRIES, writer="fbt data embedded")  # else refused
    if not force and stamp.is_file():
        try:
            stamped = json.loads(stamp.read_text())
        except ValueError:  # not JSON, not UTF-8: an unfinished or damaged build of this project's, rebuilt
            stamped = {}
        stamped = stamped if isinstance(stamped, dict) else {}
        prev = stamped.get("settings") if isinstance(stamped.get("settings"), dict) else {}
        same = {k: v for k, v in prev.items() if k not in corpus} == {k: v for k, v in settings.items() if k not in corpus}
        if same and all((out / n / INDEX_FILE).is_file() for n in TOKEN_SHARES) \
                and (out / "tokenizer.model").is_file() and (out / "mix.yaml").is_file() \
                and tokenizer_hash(out / "tokenizer.model") == stamped.get("tokenizer_hash"):
            if prev.get("python") == corpus["python"] and prev.get("stdlib") == corpus["stdlib"]:
                log(f"embedded data already built in {out} (same settings); skipping")
            else:  # a run may be reading it: never rebuild it under another Python's feet
                log(f"embedded data in {out} was built from Python {prev.get('python')}'s standard library "
                    f"({prev.get('stdlib')}); using it (--force rebuilds it from this Python's)")
            data = embedded_section(out, seq_length=seq_length, seed=seed)
            _point_mix_here(out, log)
            return data
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"building": settings}))  # the directory is a build's from now on (not done yet)
    files = stdlib_files()
    workers = num_workers or max(1, os.cpu_count() or 1)
    makers = {
        "code": lambda: code_documents(files, int(code_mb * 1e6), seed),
        "prose": lambda: prose_documents(files, int(prose_mb * 1e6)),
        "math": lambda: math_documents(math_docs, seed),
    }
    # tokenizer: trained on a sample of every source (every source contributes about equally)
    sample = []
    for name, make in makers.items():
        budget = 1_500_000
        for _, text in make():
            sample.append(text)
            budget -= len(text)
            if budget <= 0:
                break
    log(f"training tokenizer (vocab {vocab_size}) on {sum(map(len, sample)) / 1e6:.1f} MB of text")
    thash = train_tokenizer(sample, out / "tokenizer.model", vocab_size=vocab_size, max_sentences=200_000,
                            num_threads=workers)
    del sample
    summary = {}
    for name, make in makers.items():
        idx = prepare_dataset([], out / name, out / "tokenizer.model", name=name, shard_bytes=1 << 20,
                              num_workers=workers, progress=progress, documents=make(),
                              extra_meta={"embedded": settings}, overwrite=True)  # a dataset of this build
        summary[name] = {"samples": idx["num_samples"], "tokens": idx["num_tokens"], "shards": idx["num_shards"]}
        log(f"  {name}: {idx['num_samples']} documents, {idx['num_tokens']} tokens, {idx['num_shards']} shards")
    data = embedded_section(out, seq_length=seq_length, seed=seed)
    header = "# Embedded default token mix (fbt data embedded). Weights are shares of the stream's tokens.\n"
    (out / "mix.yaml").write_text(header + yaml.safe_dump({"data": data}, sort_keys=False))
    stamp.write_text(json.dumps({"settings": settings, "tokenizer_hash": thash, "summary": summary,
                                 "seconds": round(time.time() - t0, 1)}, indent=1))
    log(f"embedded data built in {out} in {time.time() - t0:.1f}s; recipe section in {out / 'mix.yaml'}")
    return data
