"""The GPU check: what one GPU (``make gpu-check``) or a node of 2-8 (``make gpu-check-multi``) proves
that the CPU test suite cannot. No network; about 10 minutes on one H100/H200.

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--only STEP,...]
    python benchmarks/gpu_check.py --multi [--gpus N] [--out runs/gpu_check_multi]

One GPU, in order (a step that fails is recorded with its error and the next one runs):
1. ``gpu_tests``: the GPU tests (``pytest -m gpu``) in a session that keeps CUDA (no CPU override);
2. ``te_packed_vs_mask``: Transformer Engine's packed (THD) attention against its dense-mask path on the
   same weights in bf16, 1 and 3 passes: loss and every gradient;
3. ``train_1b``: the 1B recipe's model, forward/backward + AdamW at 1 and 3 passes: tokens/s, MFU, peak
   memory against ``fbt plan``'s figure for the same layout (``benchmarks/gpu_smoke.py``'s step);
4. ``host_syncs``: host synchronisations of a packed 3-pass forward/backward counted under
   ``torch.cuda.set_sync_debug_mode``: the same count at 2 and at 4 layers (none per layer);
5. ``zero1_bf16_resume``: ``fbt train`` of a tiny model, bf16, DeepSpeed ZeRO-1: a run stopped and saved at
   step 3 and resumed matches the straight run's losses;
6. ``full_recompute``: ``model.recompute: full`` gives the loss and gradients of no recompute on the same
   weights, with a lower peak.
``--multi`` (2-8 GPUs): ``fbt train`` of the tiny model at TP=2 with sequence parallelism, PP=2 with
3-pass steps and DP=2, each against the single-GPU run of the same recipe (losses step by step).

Writes OUT/gpu_check.json (every step: status, seconds, measurements or the error) and prints a
summary naming the failed steps. Exit status 0: every step passed; 1: a step failed; 2: refused (no
CUDA device, or FBT_DEVICE=cpu). On CPU it refuses: the CPU suite is ``make test``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SINGLE_STEPS = ("gpu_tests", "te_packed_vs_mask", "train_1b", "host_syncs", "zero1_bf16_resume", "full_recompute")
MULTI_STEPS = ("tp2_sp", "pp2_k3", "dp2")
TINY_STEPS = 6  # fbt train steps of the tiny runs (feedback from step 2)


class CheckFailed(AssertionError):
    """A step ran and its result is wrong (as opposed to a step that crashed)."""


def refuse_reason() -> str | None:
    """Why this machine cannot run the GPU check (None when it can)."""
    import torch

    if os.environ.get("FBT_DEVICE", "").lower() == "cpu":
        return "FBT_DEVICE=cpu forces the CPU path; unset it on a GPU node"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False); the CPU suite is `make test`"
    return None


def run_steps(steps: dict, out_dir: Path, print_fn=print) -> dict:
    """Run ``steps`` (name -> function returning a dict of measurements) in order; a step that raises is
    recorded (``failed`` for a wrong result, ``error`` for a crash, with the traceback's last lines) and the
    next one runs. Writes ``out_dir/gpu_check.json`` after every step; returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        try:
            entry = {"status": "passed", **(fn() or {})}
        except CheckFailed as e:
            entry = {"status": "failed", "error": str(e)}
        except Exception as e:  # a crash: keep going, say where
            entry = {"status": "error", "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc().splitlines()[-12:]}
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = entry
        print_fn(f"gpu_check: {name}: {entry['status']} ({entry['seconds']} s)"
                 + (f": {entry['error']}" if "error" in entry else ""))
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    failed = [n for n, e in report["steps"].items() if e["status"] != "passed"]
    report["failed"] = failed
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# --------------------------------------------------------------------------- one GPU
def gpu_tests() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FBT_DEVICE", "DS_ACCELERATOR")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                        str(ROOT / "tests")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    tail = r.stdout.strip().splitlines()[-8:]
    check(r.returncode == 0, f"pytest -m gpu exited {r.returncode}: {' | '.join(tail)}")
    check(" skipped" not in tail[-1], f"a GPU test skipped: {' | '.join(tail)}")
    return {"pytest": tail[-1]}


def _llama(layers: int, **update):
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "fbt-1b-400b.yaml")
    return recipe, recipe.model.model_copy(update={"num_layers": layers, **update})


def _loss_and_grads(model, batch, passes: int):
    import torch

    model.zero_grad(set_to_none=True)
    # the training jitter from a seeded generator: the models compared draw the same noise
    out = model(batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"], num_passes=passes,
                jitter_seed=7)
    loss = out.token_loss.float().mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_grad(a: dict, b: dict) -> tuple[str, float]:
    check(a.keys() == b.keys(), f"gradients of different parameters: {sorted(a.keys() ^ b.keys())[:4]}")
    worst = max(((n, float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12))) for n in a), key=lambda x: x[1])
    return worst


def te_packed_vs_mask() -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.model.fbt_gpt import build_model

    recipe, small = _llama(2)
    batch = gpu_smoke.packed_batch(2, 1024, small.vocab_size, torch.Generator().manual_seed(7), "cuda")
    rows = {}
    for passes in (1, 3):
        results = []
        for packed in (True, False):
            torch.manual_seed(0)
            model = build_model(small, recipe.feedback, dtype=torch.bfloat16, packed=packed).train()
            check(model.attention_backend == ("packed" if packed else "unfused"),
                  f"attention ran as {model.attention_backend!r} (TE layers expected)")
            results.append(_loss_and_grads(model, batch, passes))
            del model
        (packed_loss, packed_grads), (mask_loss, mask_grads) = results
        name, rel = _worst_grad(packed_grads, mask_grads)
        rows[passes] = {"packed_loss": packed_loss, "mask_loss": mask_loss, "worst_grad": name, "worst_grad_rel": rel}
        check(abs(packed_loss - mask_loss) <= 2e-2 * abs(mask_loss), f"k={passes}: loss {packed_loss} vs {mask_loss}")
        check(rel <= 5e-2, f"k={passes}: gradient of {name} differs by {rel:.3g} (relative norm; bf16 tolerance 5e-2)")
    torch.cuda.empty_cache()
    return {"passes": rows}


def train_1b() -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "fbt-1b-400b.yaml")
    gpu = gpu_smoke.gpu_name_for_plan()
    rows = {}
    for passes in (1, 3):
        r = gpu_smoke.train_steps(recipe, passes, 3, recipe.batch.micro_batch_size, gpu)
        rows[passes] = {k: r[k] for k in ("step_s", "tokens_s", "mfu", "peak_gb", "plan_gb", "backend")}
        check(r["backend"] == "packed", f"k={passes}: attention ran as {r['backend']!r}, not packed documents")
        check(all(math.isfinite(x) for x in r["losses"]), f"k={passes}: a loss is not finite: {r['losses']}")
        check(r["peak_gb"] <= 1.25 * r["plan_gb"], f"k={passes}: peak {r['peak_gb']:.1f} GB over 1.25 x the plan's "
                                                    f"{r['plan_gb']:.1f} GB")
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "plan_device": gpu, "passes": rows}


def _sync_count(layers: int) -> int:
    import warnings

    import torch

    import gpu_smoke
    from fbt_megatron.model.fbt_gpt import build_model

    recipe, small = _llama(layers)
    torch.manual_seed(0)
    model = build_model(small, recipe.feedback, dtype=torch.bfloat16).train()
    batch = gpu_smoke.packed_batch(2, 1024, small.vocab_size, torch.Generator().manual_seed(3), "cuda")
    _loss_and_grads(model, batch, 3)  # warm-up (lazy initialisation may sync once)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.zero_grad(set_to_none=True)
            out = model(batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"], num_passes=3,
                        jitter_seed=7)
            out.token_loss.float().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def host_syncs() -> dict:
    two, four = _sync_count(2), _sync_count(4)
    check(four == two, f"host syncs grow with depth: {two} at 2 layers, {four} at 4 (a sync per layer)")
    return {"syncs_per_3pass_step": two, "at_4_layers": four}


def _tiny(run_dir: Path, **sections) -> dict:
    from harness import tiny_recipe

    sections.setdefault("train", {"steps": TINY_STEPS})
    return tiny_recipe(str(run_dir), precision="bf16", **sections)  # feedback from step 2, mix 0.2/0.5/0.3


def _fbt_train(recipe_data: dict, gpus: int, work: Path) -> dict:
    """``fbt train`` of ``recipe_data`` on ``gpus`` GPUs (torchrun, this script's worker); rank 0's summary."""
    work.mkdir(parents=True, exist_ok=True)
    recipe_path, summary_path = work / f"recipe.{time.time_ns()}.json", work / f"summary.{time.time_ns()}.json"
    recipe_path.write_text(json.dumps(recipe_data))
    env = {k: v for k, v in os.environ.items() if k not in ("FBT_DEVICE", "DS_ACCELERATOR")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                        __file__, "--worker", str(recipe_path), str(summary_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=540)
    if r.returncode != 0:
        raise RuntimeError(f"fbt train on {gpus} GPU(s) exited {r.returncode}: "
                           + " | ".join((r.stdout + r.stderr).strip().splitlines()[-6:]))
    return json.loads(summary_path.read_text())


def _losses(summary: dict) -> list[float]:
    return [h[2] for h in summary["history"]]


def zero1_bf16_resume(work: Path) -> dict:
    sections = dict(parallel={"tensor": 1, "zero_stage": 1}, checkpoint={"every": 1000, "at_end": True, "keep_last": 2})
    straight = _fbt_train(_tiny(work / "straight", **sections), 1, work)
    first = _tiny(work / "resumed", **sections)
    first["train"]["stop_at_step"] = 3
    a = _fbt_train(first, 1, work)
    check(a["step"] == 3 and a["checkpoint"], f"the first half stopped at {a['step']} (checkpoint {a['checkpoint']})")
    b = _fbt_train(_tiny(work / "resumed", **sections), 1, work)
    check(b["history"][0][0] == a["step"], f"the resumed run started at step {b['history'][0][0]}, not 3")
    got, ref = _losses(a) + _losses(b), _losses(straight)
    worst = max(abs(x - y) for x, y in zip(got, ref))
    check([h[1] for h in a["history"] + b["history"]] == [h[1] for h in straight["history"]], "pass counts differ")
    check(worst <= 1e-3, f"resumed losses differ from the straight run's by up to {worst:.3g}: {got} vs {ref}")
    return {"losses": ref, "max_abs_diff": worst}


def full_recompute() -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.model.fbt_gpt import build_model

    recipe, base = _llama(4)
    batch = gpu_smoke.packed_batch(4, 2048, base.vocab_size, torch.Generator().manual_seed(5), "cuda")
    results = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = build_model(base.model_copy(update={"recompute": mode}), recipe.feedback, dtype=torch.bfloat16).train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, grads = _loss_and_grads(model, batch, 3)
        results[mode] = (loss, grads, (torch.cuda.max_memory_allocated() - before) / 1e9)
        del model
        torch.cuda.empty_cache()
    (loss0, grads0, peak0), (loss1, grads1, peak1) = results["none"], results["full"]
    name, rel = _worst_grad(grads1, grads0)
    check(abs(loss1 - loss0) <= 1e-3 * abs(loss0), f"loss with full recompute {loss1} vs {loss0}")
    check(rel <= 2e-2, f"gradient of {name} differs by {rel:.3g} with full recompute")
    check(peak1 < peak0, f"full recompute's peak {peak1:.2f} GB is not below no recompute's {peak0:.2f} GB")
    return {"loss": loss0, "worst_grad": name, "worst_grad_rel": rel, "peak_gb_none": peak0, "peak_gb_full": peak1}


# --------------------------------------------------------------------------- 2-8 GPUs
def _against_single(work: Path, name: str, gpus: int, parallel: dict, **sections) -> dict:
    single = _fbt_train(_tiny(work / f"{name}_single", **sections), 1, work)
    multi = _fbt_train(_tiny(work / name, parallel=parallel, **sections), gpus, work)
    got, ref = _losses(multi), _losses(single)
    check([h[1] for h in multi["history"]] == [h[1] for h in single["history"]], f"{name}: pass counts differ")
    check(name != "pp2_k3" or 3 in [h[1] for h in multi["history"]], f"{name}: no 3-pass step ran")
    worst = max(abs(x - y) / abs(y) for x, y in zip(got, ref))
    check(worst <= 2e-2, f"{name}: losses differ from the single-GPU run's by up to {worst:.3g} (relative): "
                         f"{got} vs {ref}")
    return {"losses": got, "single": ref, "max_rel_diff": worst, "passes": [h[1] for h in multi["history"]]}


def multi_steps(work: Path, gpus: int) -> dict:
    return {
        "tp2_sp": lambda: _against_single(work, "tp2_sp", 2, {"tensor": 2, "sequence_parallel": True, "zero_stage": 1}),
        "pp2_k3": lambda: _against_single(work, "pp2_k3", 2, {"pipeline": 2, "zero_stage": 1},
                                          schedule={"feedback_start_step": 2, "mix": [0.0, 0.0, 1.0], "seed": 3}),
        "dp2": lambda: _against_single(work, "dp2", 2, {"zero_stage": 1}),
    }


def worker(recipe_path: str, summary_path: str) -> int:
    """torchrun's entry (``--worker``): ``fbt train`` of the recipe; rank 0 writes its summary."""
    import torch.distributed as dist

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator
    from harness import train_summary

    ensure_ds_accelerator()
    runtime.init_distributed()
    try:
        summary = train_summary(json.loads(Path(recipe_path).read_text()))
        if dist.get_rank() == 0:
            Path(summary_path).write_text(json.dumps(summary, default=str))
    finally:
        runtime.shutdown()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="where gpu_check.json goes (default runs/gpu_check[_multi])")
    ap.add_argument("--multi", action="store_true", help="the 2-8 GPU checks (TP=2+SP, PP=2 with 3 passes, DP=2)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for --multi (default: every visible one)")
    ap.add_argument("--only", default=None, help="comma-separated step names")
    ap.add_argument("--worker", nargs=2, metavar=("RECIPE_JSON", "SUMMARY_JSON"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    reason = refuse_reason()
    if reason:
        print(f"gpu_check: refusing: {reason}", file=sys.stderr)
        return 2
    import torch

    out = Path(a.out or ROOT / "runs" / ("gpu_check_multi" if a.multi else "gpu_check"))
    work = Path(tempfile.mkdtemp(prefix="fbt_gpu_check_"))
    if a.multi:
        gpus = a.gpus or torch.cuda.device_count()
        if not 2 <= gpus <= 8:
            print(f"gpu_check: refusing: --multi needs 2-8 GPUs, this node has {gpus}", file=sys.stderr)
            return 2
        steps = multi_steps(work, gpus)
    else:
        from fbt_megatron import runtime

        runtime.init_distributed()
        runtime.init_parallel_state(runtime.ParallelLayout())
        steps = {"gpu_tests": gpu_tests, "te_packed_vs_mask": te_packed_vs_mask, "train_1b": train_1b,
                 "host_syncs": host_syncs, "zero1_bf16_resume": lambda: zero1_bf16_resume(work),
                 "full_recompute": full_recompute}
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - set(steps))
        if unknown:
            print(f"gpu_check: unknown step(s) {unknown}; these are: {list(steps)}", file=sys.stderr)
            return 2
        steps = {n: steps[n] for n in wanted}
    print(f"gpu_check: {len(steps)} step(s) on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}; report {out / 'gpu_check.json'}")
    report = run_steps(steps, out)
    failed = report["failed"]
    print("gpu_check: all steps passed" if not failed else f"gpu_check: FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
