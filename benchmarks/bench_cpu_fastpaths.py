"""What each CPU fast path (``fbt_megatron/model/cpu_fastpaths.py``) gains, side by side in one process.

    python benchmarks/bench_cpu_fastpaths.py [--sizes tiny,medium] [--blocks 30] [--medium-blocks N]
                                             [--only rope,...] [--raw] [--write]

One model and engine per size, built as ``fbt train`` builds them for the research recipe
(``recipes/tiny.yaml``: GELU, LayerNorm, tied embeddings, the glu fusion, ZeRO-1, micro-batch 8 x 2
accumulation x 128 tokens; ``medium`` is the feedback study's 8 layers x 384), 1-pass training steps.
Per shortcut, ``--blocks`` ABBA blocks: one step with every shortcut on, two with that shortcut off (the
others on), one with all on again; the block's ratio is off over on (> 1: the shortcut gains). The figure
is the median of the blocks' ratios, with their quartiles. The two sides of a ratio run within a second of
each other: on a shared machine whose load comes in bursts (a step taking several times its quiet time for
seconds at a time) a burst mostly slows a whole block, where per-variant medians over rounds moved with
the bursts; the table adds the median over the quiet blocks alone (``QUIET``). ``all off`` is the same
against every shortcut off. ``--write`` replaces the section of
``docs/results/benchmarks.md`` with the table, date, commit and load.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("FBT_DEVICE", "cpu")

QUIET = 1.3  # a quiet block: its slowest step within 30 % of its fastest (no burst of load inside it)
SIZES = {"tiny": [], "medium": ["model.num_layers=8", "model.hidden_size=384", "model.num_attention_heads=6"]}
DOC = ROOT / "docs" / "results" / "benchmarks.md"
BEGIN, END = "<!-- bench_cpu_fastpaths: begin -->", "<!-- bench_cpu_fastpaths: end -->"


def research_recipe(size: str):
    from fbt_megatron.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / "tiny.yaml", SIZES[size] + [
        "data.source=synthetic", "data.synthetic.vocab_size=4096", "schedule.feedback_start_step=1000000000"])


def measure(size: str, blocks: int, only=None, raw: bool = False) -> dict[str, list[tuple[float, bool]]]:
    """Per shortcut (and ``all off``), ``blocks`` ratios: step time with it off over step time with all on,
    each from one ABBA block (on, off, off, on: one step each, the same batch), so that the two sides of a
    ratio run within a second of each other (module doc); with each, whether the block was quiet."""
    from bench_train import batches, fbt_step_fn

    from fbt_megatron.model import cpu_fastpaths as room

    recipe = research_recipe(size)
    step, _ = fbt_step_fn(recipe)
    if not room.active():
        raise SystemExit("the CPU fast paths were not installed (FBT_CPU_FASTPATHS=0, or a version mismatch?)")
    data = batches(recipe, 0, 1, 4)
    variants = {name: (name,) for name in only or room.SHORTCUTS} | {"all off": room.SHORTCUTS}
    counter = iter(range(10**9))

    def timed(off):
        room.install("cpu")
        room.uninstall(off)
        i = next(counter)
        t0 = time.perf_counter()
        step(i, data[i % len(data)])
        return time.perf_counter() - t0

    for off in variants.values():  # warm-up: every variant's first steps untimed
        timed(off)
        timed(())
    ratios = {name: [] for name in variants}
    for b in range(blocks):
        for name, off in variants.items():
            on_1, off_1, off_2, on_2 = block = timed(()), timed(off), timed(off), timed(())
            ratios[name].append(((off_1 + off_2) / (on_1 + on_2), max(block) < QUIET * min(block)))
            if raw:
                print(size, b, name, f"on {on_1 * 1e3:.0f} {on_2 * 1e3:.0f} off {off_1 * 1e3:.0f} {off_2 * 1e3:.0f}",
                      flush=True)
    room.install("cpu")
    return ratios


def table(results: dict[str, dict[str, list[tuple[float, bool]]]]) -> list[str]:
    """Per shortcut and size: the median of the blocks' off / on ratios, their quartiles, and the median over
    the quiet blocks alone (with their number)."""
    sizes = list(results)
    lines = ["| shortcut | " + " | ".join(f"{s}: off / on, median (quartiles); quiet blocks" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name in next(iter(results.values())):
        cells = []
        for s in sizes:
            ratios = [r for r, _ in results[s][name]]
            quiet = [r for r, q in results[s][name] if q]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            cells.append(f"{statistics.median(ratios):.3f} ({q1:.3f}-{q3:.3f}); "
                         + (f"{statistics.median(quiet):.3f} ({len(quiet)})" if quiet else "none"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| (blocks) | " + " | ".join(str(len(next(iter(results[s].values())))) for s in sizes) + " |")
    return lines


def write_doc(lines: list[str], a, load: tuple) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    section = [BEGIN, "## The CPU fast paths, each off against all on (issue 42)", "",
               f"`python benchmarks/bench_cpu_fastpaths.py --sizes {a.sizes} --blocks {a.blocks}"
               f"{f' --medium-blocks {a.medium_blocks}' if a.medium_blocks else ''}`, "
               f"{time.strftime('%Y-%m-%d')}, commit {commit}{' (+ uncommitted changes)' if dirty else ''}, "
               f"{platform.machine()} with {os.cpu_count()} cores, {a.threads} torch threads, load average "
               f"{load[0]:.2f} before / {load[1]:.2f} after. Step time with the shortcut off (the others on) over "
               "all on, wall clock, median (quartiles) of ABBA blocks in one process; the research recipe (`recipes/tiny.yaml`: "
               "GELU, LayerNorm, tied, glu fusion, ZeRO-1, 2048 tokens a step, 1 pass; `medium`: 8 layers x 384). "
               "A shortcut stays in `model/cpu_fastpaths.py` at >= 1.02 at a research size (tiny or medium); the ZeRO ones are judged by `benchmarks/bench_train.py`, a process per variant (their gain is fresh memory faulted in every step, which one process alternating variants does not see).", ""] + lines + ["", END]
    text = DOC.read_text()
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + "\n".join(section) + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    DOC.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,medium")
    ap.add_argument("--blocks", type=int, default=30, help="ABBA blocks per shortcut")
    ap.add_argument("--medium-blocks", type=int, help="blocks at the medium size (default: --blocks)")
    ap.add_argument("--only", help="the shortcuts to switch off one at a time (default: all of them)")
    ap.add_argument("--raw", action="store_true", help="print every round's times (wall/CPU ms)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--write", action="store_true", help="update the section of docs/results/benchmarks.md")
    a = ap.parse_args()

    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    ensure_ds_accelerator()
    torch.set_num_threads(a.threads)
    runtime.init_distributed()
    load_before = os.getloadavg()[0]
    results = {}
    for size in a.sizes.split(","):
        blocks = a.medium_blocks if size == "medium" and a.medium_blocks else a.blocks
        results[size] = measure(size, blocks, a.only.split(",") if a.only else None, a.raw)
        print(size, {k: round(statistics.median(r for r, _ in v), 3) for k, v in results[size].items()}, flush=True)
    lines = table(results)
    print("\n".join(lines))
    if a.write:
        write_doc(lines, a, (load_before, os.getloadavg()[0]))
    runtime.shutdown()


if __name__ == "__main__":
    main()
