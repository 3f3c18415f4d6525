"""The GPU check: what one GPU (``make gpu-check``) or a node of 2-8 (``make gpu-check-multi``) proves
that the CPU test suite cannot. No network: packages come from a wheelhouse (``make gpu-wheels``).

    python benchmarks/gpu_check.py [--wheels build/gpu-wheels] [--budget 480] [--out runs/gpu_check] [--only STEP,...]
    python benchmarks/gpu_check.py --multi [--gpus N] [--budget 480] [--out runs/gpu_check_multi]

One GPU, in order of value (a step that fails is recorded with its error and the next one runs):
0. ``install``: the wheelhouse into this Python (``pip --no-index --no-deps``): each wheel whose
   distribution this Python lacks, and the project's own; its torch and every package it has are kept;
1. ``zero1_bf16_resume``: ``fbt train`` of a tiny model, bf16, DeepSpeed ZeRO-1: a run stopped and saved at
   step 3 and resumed matches the straight run's losses;
2. ``te_packed_vs_mask`` (Transformer Engine): TE's packed (THD) attention against its dense-mask path on
   the same weights in bf16, 1 and 3 passes: loss and every gradient;
3. ``train_1b``: the 1B recipe's model trained as ``fbt train`` trains it (DeepSpeed ZeRO-1, bf16 with
   fp32 masters) at 1 and 3 passes: tokens/s, MFU, peak memory against ``fbt plan``'s figure
   (``benchmarks/gpu_smoke.py``'s step);
4. ``full_recompute``: ``model.recompute: full`` gives the loss and gradients of no recompute on the same
   weights, with a lower peak;
5. ``host_syncs``: host synchronisations of a 3-pass forward/backward counted under
   ``torch.cuda.set_sync_debug_mode``: the same count at 2 and at 4 layers (none per layer);
6. ``gpu_tests`` (Transformer Engine): the GPU tests (``pytest -m gpu``) in a session that keeps CUDA.
Without Transformer Engine the steps marked so are ``not run`` and the others run on Megatron's local
layers (torch SDPA attention).
``--multi`` (2-8 GPUs): ``fbt train`` of the tiny model at TP=2 with sequence parallelism, PP=2 with
3-pass steps and DP=2, each against the single-GPU run of the same recipe from the same initial
checkpoint (``init_from``), in fp32: losses step by step within 1e-3.

Before running, it prints each step's estimate (from its parts). ``--budget SECONDS``: a step whose
estimate does not fit what is left is skipped, and one still running when the budget ends is stopped.
OUT/gpu_check.json is written at the start and after every step: per step ``status`` (``ok``,
``failed``, ``not run``, ``skipped``), ``reason`` or ``error``, ``seconds``, ``estimate_s`` and its
measurements. Exit status 0: no step failed (the summary names those not run or skipped); 1: a step
failed; 2: refused (no CUDA device, or FBT_DEVICE=cpu; the JSON lists every step as not run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "benchmarks", ROOT):  # the work tree's code, whatever the wheelhouse installed; harness
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

DEFAULT_WHEELS = ROOT / "build" / "gpu-wheels"
DEFAULT_BUDGET_S = 480.0
TINY_STEPS = 6  # fbt train steps of the tiny runs (feedback from step 2)
PROJECT_DIST = "fbt-megatron"
# Built against the image's CUDA: never installed from the wheelhouse (make gpu-wheels leaves them out).
NEVER_INSTALLED = re.compile(r"^(torch|triton|nvidia-.*|transformer-engine.*)$")
NEEDED_MODULES = ("megatron.core", "deepspeed", "pydantic", "yaml", "numpy")


class CheckFailed(AssertionError):
    """A step ran and its result is wrong (as opposed to a step that crashed)."""


class NotRun(Exception):
    """A step that cannot run here (its message is the reason, e.g. no Transformer Engine)."""


class BudgetExceeded(BaseException):
    """Raised in the main thread when ``--budget`` runs out while a step runs (BaseException: a step's own
    ``except Exception`` does not swallow it)."""


@dataclass
class Step:
    name: str
    fn: Callable[[], dict | None]
    estimate_s: float
    parts: str = ""  # what the estimate is made of, printed beside it
    needs_te: bool = False


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def refuse_reason() -> str | None:
    """Why this machine cannot run the GPU check (None when it can)."""
    if os.environ.get("FBT_DEVICE", "").lower() == "cpu":
        return "FBT_DEVICE=cpu forces the CPU path; unset it on a GPU node"
    try:
        import torch
    except ImportError:
        return "torch is not importable in this Python; run the check with the GPU image's Python (GPU_PY=...)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False); the CPU suite is `make test`"
    return None


def te_missing_reason() -> str | None:
    """``no Transformer Engine (...)`` where it is not importable, None where it is."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a TE built against another torch/CUDA
        return f"no Transformer Engine ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def missing_modules(names=NEEDED_MODULES) -> list[str]:
    """The modules the steps import that this Python cannot find."""
    missing = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:
            missing.append(name)
    return missing


# --------------------------------------------------------------------------- running steps under a budget
def _write(report: dict, out_dir: Path) -> None:
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))


def _on_alarm(signum, frame):
    raise BudgetExceeded()


def run_steps(steps: list[Step], out_dir: Path, budget_s: float | None = None, header: dict | None = None,
              not_run_reason: Callable[[Step], str | None] = lambda step: None, print_fn=print,
              clock=time.monotonic) -> dict:
    """Run ``steps`` in order. Each gets a status: ``ok`` (with its measurements), ``failed`` (a wrong
    result, or a crash with the traceback's last lines), ``not run`` (``not_run_reason(step)`` or the step
    raised :class:`NotRun`), ``skipped`` (``budget_s``: its estimate did not fit what was left, or the
    budget ran out while it ran: it is stopped by SIGALRM). ``out_dir/gpu_check.json`` is written before
    the first step (every step ``pending``) and after each; returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = clock()
    report = {**(header or {}), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "budget_s": budget_s,
              "steps": {s.name: {"status": "pending", "estimate_s": round(s.estimate_s)} for s in steps}}
    _write(report, out_dir)
    for step in steps:
        left = None if budget_s is None else budget_s - (clock() - start)
        entry = {"estimate_s": round(step.estimate_s)}
        reason = not_run_reason(step)
        t0 = clock()
        if reason:
            entry.update(status="not run", reason=reason)
        elif left is not None and step.estimate_s > left:
            entry.update(status="skipped", reason=f"budget: estimated {step.estimate_s:.0f} s, "
                                                  f"{max(left, 0):.0f} s of {budget_s:.0f} s left")
        else:
            previous = None
            if left is not None:
                previous = signal.signal(signal.SIGALRM, _on_alarm)
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
            try:
                entry.update(status="ok", **(step.fn() or {}))
            except BudgetExceeded:
                entry.update(status="skipped", reason=f"budget: stopped after {clock() - t0:.0f} s, "
                                                      f"when the {budget_s:.0f} s ran out")
            except NotRun as e:
                entry.update(status="not run", reason=str(e))
            except CheckFailed as e:
                entry.update(status="failed", error=str(e))
            except Exception as e:  # a crash: keep going, say where
                entry.update(status="failed", error=f"{type(e).__name__}: {e}",
                             traceback=traceback.format_exc().splitlines()[-12:])
            finally:
                if left is not None:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, previous)
        entry["seconds"] = round(clock() - t0, 1)
        report["steps"][step.name] = entry
        detail = entry.get("error") or entry.get("reason")
        print_fn(f"gpu_check: {step.name}: {entry['status']} ({entry['seconds']} s)" + (f": {detail}" if detail else ""))
        _write(report, out_dir)
    report["seconds"] = round(clock() - start, 1)
    report["failed"] = [n for n, e in report["steps"].items() if e["status"] == "failed"]
    report["summary"] = {status: [n for n, e in report["steps"].items() if e["status"] == status]
                         for status in ("ok", "failed", "not run", "skipped")}
    _write(report, out_dir)
    return report


def refusal_report(steps: list[Step], reason: str, out_dir: Path, budget_s: float | None) -> dict:
    """The JSON of a refused check: every step ``not run`` with the refusal as its reason."""
    return run_steps(steps, out_dir, budget_s, header={"refused": reason},
                     not_run_reason=lambda step: reason, print_fn=lambda *a: None)


# --------------------------------------------------------------------------- the wheelhouse
def wheel_distribution(filename: str) -> str:
    """The normalised distribution name of a wheel file (``megatron_core-0.19.2-...whl`` -> megatron-core)."""
    return re.sub(r"[-_.]+", "-", filename.split("-")[0]).lower()


def installed_distributions() -> set[str]:
    from importlib import metadata

    return {re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() for d in metadata.distributions()}


def wheels_to_install(wheels: list[Path], installed: set[str]) -> list[Path]:
    """The wheels whose distribution this Python lacks, and the project's own (always: it is the code
    under test). Refuses a wheelhouse holding torch, Triton, TE or an NVIDIA library (the image's are kept)."""
    bad = sorted(w.name for w in wheels if NEVER_INSTALLED.match(wheel_distribution(w.name)))
    if bad:
        raise CheckFailed(f"the wheelhouse holds {bad}: the image's own builds are kept; rebuild it with make gpu-wheels")
    return [w for w in wheels if wheel_distribution(w.name) == PROJECT_DIST or wheel_distribution(w.name) not in installed]


def install_wheelhouse(wheels_dir: Path | None, python: str = sys.executable) -> dict:
    """The ``install`` step: ``pip install --no-index --no-deps`` of :func:`wheels_to_install`; then the
    modules the steps need must import."""
    if wheels_dir is None or not wheels_dir.is_dir():
        missing = missing_modules()
        if missing:
            raise CheckFailed(f"no wheelhouse at {wheels_dir} and {', '.join(missing)} not importable: build it "
                              f"with `make gpu-wheels` where there is network and copy build/gpu-wheels here")
        raise NotRun(f"no wheelhouse at {wheels_dir}; this Python already has every package the check imports")
    wheels = wheelhouse_wheels(wheels_dir)
    check(bool(wheels), f"the wheelhouse {wheels_dir} holds no wheels: rebuild it with make gpu-wheels")
    listed = (wheels_dir / "MANIFEST").read_text().split() if (wheels_dir / "MANIFEST").is_file() else []
    lost = sorted(set(listed) - {w.name for w in wheels})
    check(not lost, f"the wheelhouse {wheels_dir} lacks {', '.join(lost)}, which its MANIFEST lists: copy the "
                    "whole folder again")
    chosen = wheels_to_install(wheels, installed_distributions())
    cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-warn-script-location",
           "--disable-pip-version-check", *map(str, chosen)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-4:]
    check(r.returncode == 0, f"pip install from the wheelhouse exited {r.returncode}: {' | '.join(tail)}")
    importlib.invalidate_caches()
    missing = missing_modules()
    check(not missing, f"{', '.join(missing)} still not importable after installing the wheelhouse")
    return {"installed": [w.name for w in chosen], "kept": len(wheels) - len(chosen),
            "wheelhouse_mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 1)}


def wheelhouse_wheels(wheels_dir: Path) -> list[Path]:
    """The wheels ``make gpu-wheels`` built into ``wheels_dir`` (listed in its MANIFEST): another wheel
    left there is not installed. A folder without MANIFEST (made by hand): every ``*.whl`` in it."""
    manifest = wheels_dir / "MANIFEST"
    if manifest.is_file():
        return sorted(wheels_dir / name for name in manifest.read_text().split() if (wheels_dir / name).is_file())
    return sorted(wheels_dir.glob("*.whl"))


def wheelhouse_mib(wheels_dir: Path | None) -> float:
    if wheels_dir is None or not wheels_dir.is_dir():
        return 0.0
    return sum(w.stat().st_size for w in wheelhouse_wheels(wheels_dir)) / 2**20


# --------------------------------------------------------------------------- one GPU
_SINGLE_GPU_READY = []


def single_gpu_process_group() -> None:
    """This process as a world of one with Megatron's parallel state (after the install step)."""
    if _SINGLE_GPU_READY:
        return
    from fbt_megatron import runtime

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    _SINGLE_GPU_READY.append(True)


def build_on_same_weights(build: Callable, variants) -> "iter":
    """Yield ``(variant, build(variant))`` for each variant, every model holding the first one's initial
    state. On a GPU the weights are drawn inside Megatron's CUDA RNG tracker
    (``use_cpu_initialization=False``), which ``torch.manual_seed`` does not reset: a second build gets
    other weights, so a "same weights" comparison must copy them."""
    import torch

    first = None
    for variant in variants:
        model = build(variant)
        if first is None:
            first = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                     for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(first)
        yield variant, model


def _llama(layers: int, **update):
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "fbt-1b-400b.yaml")
    return recipe, recipe.model.model_copy(update={"num_layers": layers, **update})


def _loss_and_grads(model, batch, passes: int):
    model.zero_grad(set_to_none=True)
    # the training jitter from a seeded generator: the models compared draw the same noise
    out = model(batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"], num_passes=passes,
                jitter_seed=7)
    loss = out.token_loss.float().mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst_grad(a: dict, b: dict) -> tuple[str, float]:
    check(a.keys() == b.keys(), f"gradients of different parameters: {sorted(a.keys() ^ b.keys())[:4]}")
    return max(((n, float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12))) for n in a), key=lambda x: x[1])


def te_packed_vs_mask() -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.model.fbt_gpt import build_model

    single_gpu_process_group()
    recipe, small = _llama(2)
    batch = gpu_smoke.packed_batch(2, 1024, small.vocab_size, torch.Generator().manual_seed(7), "cuda")
    models = dict(build_on_same_weights(
        lambda packed: build_model(small, recipe.feedback, dtype=torch.bfloat16, packed=packed).train(),
        (True, False)))
    for packed, model in models.items():
        check(model.attention_backend == ("packed" if packed else "unfused"),
              f"attention ran as {model.attention_backend!r} (TE layers expected)")
    rows = {}
    for passes in (1, 3):
        (packed_loss, packed_grads), (mask_loss, mask_grads) = (_loss_and_grads(models[p], batch, passes)
                                                                for p in (True, False))
        name, rel = _worst_grad(packed_grads, mask_grads)
        rows[passes] = {"packed_loss": packed_loss, "mask_loss": mask_loss, "worst_grad": name, "worst_grad_rel": rel}
        check(abs(packed_loss - mask_loss) <= 2e-2 * abs(mask_loss), f"k={passes}: loss {packed_loss} vs {mask_loss}")
        check(rel <= 5e-2, f"k={passes}: gradient of {name} differs by {rel:.3g} (relative norm; bf16 tolerance 5e-2)")
    del models
    torch.cuda.empty_cache()
    return {"passes": rows}


def train_1b(te: bool) -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.recipe import load_recipe

    single_gpu_process_group()
    recipe = load_recipe(ROOT / "recipes" / "fbt-1b-400b.yaml")
    gpu = gpu_smoke.gpu_name_for_plan()
    expected = "packed" if te else "sdpa"
    rows = {}
    for passes, r in gpu_smoke.train_steps(recipe, (1, 3), 3, recipe.batch.micro_batch_size, gpu).items():
        rows[passes] = {k: r[k] for k in ("step_s", "tokens_s", "mfu", "peak_gb", "plan_gb", "backend", "optimizer")}
        check(r["backend"] == expected, f"k={passes}: attention ran as {r['backend']!r}, not {expected!r}")
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
    single_gpu_process_group()
    two, four = _sync_count(2), _sync_count(4)
    check(four == two, f"host syncs grow with depth: {two} at 2 layers, {four} at 4 (a sync per layer)")
    return {"syncs_per_3pass_step": two, "at_4_layers": four}


def full_recompute() -> dict:
    import torch

    import gpu_smoke
    from fbt_megatron.model.fbt_gpt import build_model

    single_gpu_process_group()
    recipe, base = _llama(4)
    batch = gpu_smoke.packed_batch(4, 2048, base.vocab_size, torch.Generator().manual_seed(5), "cuda")
    results = {}
    builds = build_on_same_weights(
        lambda mode: build_model(base.model_copy(update={"recompute": mode}), recipe.feedback,
                                 dtype=torch.bfloat16).train(), ("none", "full"))
    for mode, model in builds:
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


def gpu_test_files() -> list[str]:
    """The test files holding GPU tests (``pytest.mark.gpu``): collecting only them, the session imports
    nothing the wheelhouse leaves out (lm-eval, datasets, ...)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def gpu_tests(timeout_s: float = 420) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FBT_DEVICE", "DS_ACCELERATOR")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                        *gpu_test_files()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = r.stdout.strip().splitlines()[-8:] or ["(no output)"]
    check(r.returncode == 0, f"pytest -m gpu exited {r.returncode}: {' | '.join(tail)}")
    check(" skipped" not in tail[-1], f"a GPU test skipped: {' | '.join(tail)}")
    return {"pytest": tail[-1]}


def _tiny(run_dir: Path, **sections) -> dict:
    from harness import tiny_recipe

    sections.setdefault("train", {"steps": TINY_STEPS})
    sections.setdefault("precision", "bf16")
    return tiny_recipe(str(run_dir), **sections)  # feedback from step 2, mix 0.2/0.5/0.3


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


# --------------------------------------------------------------------------- 2-8 GPUs
MULTI_TOLERANCE = 1e-3  # relative, per step: both runs start from one checkpoint, in fp32


def against_single_recipes(work: Path, name: str, parallel: dict, **sections) -> tuple[dict, dict, dict]:
    """(initial, single, multi) recipes: ``initial`` trains one step on one GPU and saves it; the
    single-GPU run and the run under ``parallel`` both start from that checkpoint (``init_from``). On a GPU
    the initial weights depend on the layout (Megatron draws them from RNG-tracker seeds offset per TP rank
    and per pipeline stage), so two fresh runs would not start from the same weights. fp32: the runs
    differ by reduction order only."""
    sections = {"precision": "fp32", **sections}
    initial = _tiny(work / f"{name}_initial", **{**sections, "train": {"steps": 1},
                                                 "checkpoint": {"every": 1000, "at_end": True, "keep_last": 1}})
    start = str(work / f"{name}_initial")
    single = _tiny(work / f"{name}_single", init_from=start, **sections)
    multi = _tiny(work / name, init_from=start, parallel=parallel, **sections)
    return initial, single, multi


def compare_to_single(name: str, multi: dict, single: dict, tolerance: float = MULTI_TOLERANCE) -> dict:
    got, ref = _losses(multi), _losses(single)
    check(len(got) == len(ref) and len(ref) > 0, f"{name}: {len(got)} steps against {len(ref)}")
    check([h[1] for h in multi["history"]] == [h[1] for h in single["history"]], f"{name}: pass counts differ")
    check(name != "pp2_k3" or 3 in [h[1] for h in multi["history"]], f"{name}: no 3-pass step ran")
    worst = max(abs(x - y) / abs(y) for x, y in zip(got, ref))
    check(worst <= tolerance, f"{name}: losses differ from the single-GPU run's by up to {worst:.3g} (relative, "
                              f"tolerance {tolerance:g}): {got} vs {ref}")
    return {"losses": got, "single": ref, "max_rel_diff": worst, "passes": [h[1] for h in multi["history"]]}


def _against_single(work: Path, name: str, gpus: int, parallel: dict, **sections) -> dict:
    initial, single, multi = against_single_recipes(work, name, parallel, **sections)
    _fbt_train(initial, 1, work)
    return compare_to_single(name, _fbt_train(multi, gpus, work), _fbt_train(single, 1, work))


MULTI_ESTIMATE_S = 3 * 25.0  # three fbt train launches of the tiny model (startup ~20 s each)


def multi_steps(work: Path) -> list[Step]:
    parts = "3 launches x 25 s (imports, NCCL, 6 tiny steps)"
    return [
        Step("tp2_sp", lambda: _against_single(work, "tp2_sp", 2, {"tensor": 2, "sequence_parallel": True,
                                                                     "zero_stage": 1}), MULTI_ESTIMATE_S, parts),
        Step("pp2_k3", lambda: _against_single(work, "pp2_k3", 2, {"pipeline": 2, "zero_stage": 1},
                                               schedule={"feedback_start_step": 2, "mix": [0.0, 0.0, 1.0], "seed": 3}),
             MULTI_ESTIMATE_S, parts),
        Step("dp2", lambda: _against_single(work, "dp2", 2, {"zero_stage": 1}), MULTI_ESTIMATE_S, parts),
    ]


# --------------------------------------------------------------------------- estimates and the step list
# Rough H100 figures the estimates are made of (seconds): a fresh Python importing torch, Megatron-Core
# and DeepSpeed; pip unpacking and byte-compiling one MiB of wheels; building a 1B-width model on the GPU.
LAUNCH_S, PIP_S_PER_MIB, PIP_S, BUILD_1B_S, DS_INIT_S = 20.0, 0.5, 5.0, 6.0, 10.0


def step_1b_seconds(peak_flops: float, te: bool) -> tuple[float, str]:
    """The train_1b estimate: one build, DeepSpeed's set-up (fp32 masters) and 4 steps per pass count at an
    assumed MFU (40 % on TE's packed path, 25 % on SDPA with a dense mask)."""
    params, tokens = 1.2e9, 4 * 2048
    mfu = 0.40 if te else 0.25
    step = {k: 6 * params * tokens * k / (mfu * peak_flops) for k in (1, 3)}
    total = BUILD_1B_S + DS_INIT_S + sum(4 * s for s in step.values())
    return total, (f"build {BUILD_1B_S:.0f} s + DeepSpeed {DS_INIT_S:.0f} s + 4 steps x "
                   f"{step[1]:.2f}/{step[3]:.2f} s (k=1/3 at {mfu:.0%} MFU)")


def single_steps(work: Path, wheels: Path | None, te: bool, peak_flops: float) -> list[Step]:
    mib = wheelhouse_mib(wheels)
    one_b, one_b_parts = step_1b_seconds(peak_flops, te)
    return [
        Step("install", lambda: install_wheelhouse(wheels), PIP_S + PIP_S_PER_MIB * mib + LAUNCH_S,
             f"pip {PIP_S:.0f} s + {mib:.0f} MiB x {PIP_S_PER_MIB} s + imports {LAUNCH_S:.0f} s"),
        Step("zero1_bf16_resume", lambda: zero1_bf16_resume(work), 3 * (LAUNCH_S + 5),
             f"3 launches x ({LAUNCH_S:.0f} s imports + 5 s of tiny steps)"),
        Step("te_packed_vs_mask", te_packed_vs_mask, 2 * BUILD_1B_S / 5 + 15,
             "2 builds of 2 layers + 4 forward/backward", needs_te=True),
        Step("train_1b", lambda: train_1b(te), one_b, one_b_parts),
        Step("full_recompute", full_recompute, 2 * BUILD_1B_S / 3 + 10, "2 builds of 4 layers + 2 forward/backward"),
        Step("host_syncs", host_syncs, 2 * BUILD_1B_S / 3 + 10, "2 builds of 2/4 layers + 4 forward/backward"),
        Step("gpu_tests", gpu_tests, LAUNCH_S + 2 * (BUILD_1B_S / 5 + DS_INIT_S) + 30,
             "pytest start + the smoke test's 2-layer 1B runs + the packed test", needs_te=True),
    ]


def peak_flops_of_this_gpu() -> float:
    """The GPU's dense bf16 peak from ``fbt plan``'s table (an H100's where unknown or not yet installed)."""
    if missing_modules():  # before the install step: importing the project half-way would leave it broken
        return 989e12
    try:
        import gpu_smoke
        from fbt_megatron.launch.plan import DEVICES

        return DEVICES[gpu_smoke.gpu_name_for_plan()][0]
    except (Exception, SystemExit):
        return 989e12


def print_estimates(steps: list[Step], budget_s: float | None, print_fn=print) -> None:
    total = sum(s.estimate_s for s in steps)
    print_fn(f"gpu_check: estimates (budget {'none' if budget_s is None else f'{budget_s:.0f} s'}, "
             f"all steps {total:.0f} s):")
    for s in steps:
        print_fn(f"  {s.name:<18} {s.estimate_s:>5.0f} s  {s.parts}{'  [Transformer Engine]' if s.needs_te else ''}")


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
    ap.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="the wheelhouse of make gpu-wheels "
                    "(default build/gpu-wheels; without one the installed packages are used)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help="seconds for all steps; later steps are skipped (default 480)")
    ap.add_argument("--multi", action="store_true", help="the 2-8 GPU checks (TP=2+SP, PP=2 with 3 passes, DP=2)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for --multi (default: every visible one)")
    ap.add_argument("--only", default=None, help="comma-separated step names")
    ap.add_argument("--worker", nargs=2, metavar=("RECIPE_JSON", "SUMMARY_JSON"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.budget > 0 or a.budget == float("inf"):  # parsed before the wheelhouse is installed: no shared type
        ap.error(f"argument --budget: must be a number > 0 (got {a.budget})")
    if a.worker:
        return worker(*a.worker)
    out = Path(a.out or ROOT / "runs" / ("gpu_check_multi" if a.multi else "gpu_check"))
    work = Path(tempfile.mkdtemp(prefix="fbt_gpu_check_"))
    wheels = Path(a.wheels) if a.wheels else None
    reason = refuse_reason()
    if reason is None and a.multi:
        import torch

        gpus = a.gpus or torch.cuda.device_count()
        if not 2 <= gpus <= 8:
            reason = f"--multi needs 2-8 GPUs, this node has {gpus}"
    te = reason is None and te_missing_reason() is None
    steps = multi_steps(work) if a.multi else single_steps(work, wheels, te, 989e12 if reason else peak_flops_of_this_gpu())
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            print(f"gpu_check: unknown step(s) {unknown}; these are: {[s.name for s in steps]}", file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in wanted or (s.name == "install" and not a.multi)]
    if reason:
        refusal_report(steps, reason, out, a.budget)
        print(f"gpu_check: refusing: {reason} (every step not run: {out / 'gpu_check.json'})", file=sys.stderr)
        return 2
    import torch

    print(f"gpu_check: {len(steps)} step(s) on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, Transformer Engine: "
          f"{'yes' if te else te_missing_reason()}; report {out / 'gpu_check.json'}")
    print_estimates(steps, a.budget)
    te_reason = None if te else te_missing_reason()
    header = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "transformer_engine": te_reason or "yes", "work": str(work)}
    report = run_steps(steps, out, a.budget, header=header,
                       not_run_reason=lambda step: te_reason if step.needs_te else None)
    summary = report["summary"]
    print(f"gpu_check: {len(summary['ok'])} ok, {len(summary['failed'])} failed, {len(summary['not run'])} not run, "
          f"{len(summary['skipped'])} skipped in {report['seconds']:.0f} s"
          + "".join(f"; {k}: {', '.join(v)}" for k, v in summary.items() if v and k != "ok"))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
