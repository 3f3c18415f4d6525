"""benchmarks/bench_serving.py's engine order (no vLLM needed): a warm-up engine not counted, then the
variants in an order rotated every round, so no variant always runs first or right after the same one."""

import importlib.util
import os
import sys
from pathlib import Path


def _load():
    """The benchmark module, with the environment and sys.path its import sets (FBT_DEVICE=cpu...) put back."""
    env, path = dict(os.environ), list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_serving", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serving.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


bench = _load()


def test_plan_warms_up_then_rotates():
    one = "feedback, 1 prefill pass"
    assert bench.plan(3) == [("warmup", "std"),
                             ("standard#0", "std"), ("feedback#0", "hf"), (f"{one}#0", "hf"),
                             ("feedback#1", "hf"), (f"{one}#1", "hf"), ("standard#1", "std"),
                             (f"{one}#2", "hf"), ("standard#2", "std"), ("feedback#2", "hf")]
    assert bench.OVERRIDES == {one: {"prefill_passes": 1}}


def test_seconds_leave_out_the_warmup():
    res = {"warmup": {"seconds": [9.0]}, "standard#0": {"seconds": [1.0, 2.0]}, "feedback#0": {"seconds": [3.0]},
           "feedback#1": {"seconds": [4.0]}, "standard#1": {"seconds": [5.0]},
           "feedback, 1 prefill pass#0": {"seconds": [6.0]}}
    assert bench.seconds_by_export(res) == {"standard": [1.0, 2.0, 5.0], "feedback": [3.0, 4.0],
                                            "feedback, 1 prefill pass": [6.0]}
