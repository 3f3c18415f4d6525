"""benchmarks/bench_serving.py's bookkeeping (no vLLM needed): the variants' turns rotate every round, so no
variant always runs first or right after the same one; the untimed round is left out; a per-round ratio pairs
the calls of one round; an engine process that dies (before its first answer or between calls) or hangs is an
error naming it, not a hang."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _load():
    """The benchmark module, with the environment its import sets (FBT_DEVICE=cpu...) put back."""
    env = dict(os.environ)
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_serving", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        os.environ.clear()
        os.environ.update(env)


bench = _load()
ONE = "feedback, 1 prefill pass"


def test_turns_balance_first_place_and_successors():
    """Over a cycle of 6 rounds of 3 variants: each round runs every variant once, each variant runs first
    twice, and in the calls as they run (round after round, wrapping to the cycle's start) each variant runs
    right after each other one equally often (3 of the 18 adjacent pairs) and never twice in a row."""
    from collections import Counter

    names = ["standard", "feedback", ONE]
    turns = bench.order(12)
    assert all(sorted(t) == sorted(names) for t in turns)
    assert turns[6:] == turns[:6]
    assert Counter(t[0] for t in turns[:6]) == {n: 2 for n in names}
    calls = [n for t in turns[:6] for n in t]
    pairs = Counter(zip(calls, calls[1:] + calls[:1]))
    assert pairs == {(a, b): 3 for a in names for b in names if a != b}, pairs
    assert bench.OVERRIDES == {ONE: {"prefill_passes": 1}}


def test_untimed_round_left_out_and_rounds_paired():
    calls = []

    def engine(name):
        def call():
            calls.append(name)
            return {"standard": 1.0, "feedback": 2.0, ONE: 4.0}[name] * len(calls)
        return call

    seconds = bench.timed_rounds({n: engine(n) for n in bench.EXPORTS}, rounds=2)
    assert calls == ["standard", "feedback", ONE, "standard", ONE, "feedback", ONE, "feedback", "standard"]
    # call k (1-based) takes base x k seconds; the first round's three calls are not counted
    assert seconds == {"standard": [4.0, 9.0], "feedback": [12.0, 16.0], ONE: [20.0, 28.0]}
    assert bench.paired_ratios(seconds, "feedback") == [4.0 / 12.0, 9.0 / 16.0]


def test_sessions_start_fresh_engines_and_pool_their_rounds():
    """Each session starts every variant's engine anew (one after the other), times its rounds and closes its
    engines before the next session starts; the seconds are pooled over the sessions and kept per session."""
    events = []

    class Engine:
        def __init__(self, session, i, name):
            self.session, self.name, self.calls = session, name, 0
            events.append(("start", session, i, name))

        def __call__(self):
            self.calls += 1
            return 10.0 * (self.session + 1) + self.calls

        def close(self):
            events.append(("close", self.session, self.name))

    pooled, each = bench.timed_sessions(Engine, sessions=2, rounds=1)
    names = list(bench.EXPORTS)
    starts = [("start", s, i, n) for s in range(2) for i, n in enumerate(names)]
    assert [e for e in events if e[0] == "start"] == starts
    # session 1's engines start only after session 0's are closed
    first_close = max(k for k, e in enumerate(events) if e[:2] == ("close", 0))
    assert events.index(starts[len(names)]) > first_close
    assert {e[1:] for e in events if e[0] == "close"} == {(s, n) for s in range(2) for n in names}
    # one untimed call (the engine's first), then one timed round: call 2 of each engine
    assert each == [{n: [12.0] for n in names}, {n: [22.0] for n in names}]
    assert pooled == {n: [12.0, 22.0] for n in names}


def test_a_session_that_fails_closes_the_engines_it_started():
    closed = []

    class Engine:
        def __init__(self, session, i, name):
            if i == 2:
                raise RuntimeError("engine did not start")
            self.name = name

        def close(self):
            closed.append(self.name)

    with pytest.raises(RuntimeError, match="did not start"):
        bench.timed_sessions(Engine, sessions=2, rounds=1)
    assert closed == list(bench.EXPORTS)[:2]


def _fake_python(tmp_path, body: str) -> Path:
    """A stand-in for the vLLM venv's python: called as ``python vllm_side.py --calls JOB ANSWER_FD``."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return fake


def test_an_engine_dying_between_calls_or_hanging_is_an_error_naming_it(tmp_path):
    # the started answer on the answer descriptor (python: the shell cannot name a descriptor above 9)
    answer = tmp_path / "answer.py"
    answer.write_text("import os, sys\nos.write(int(sys.argv[1]), b'{}\\n')\n")
    answers_once = f'{sys.executable} {answer} "$4"\n'
    dies = bench.EngineProcess(_fake_python(tmp_path, answers_once + "echo 'gone' >&2\nexit 5\n"),
                               {"name": "feedback"}, dict(os.environ), tmp_path, "engine1")
    with pytest.raises(RuntimeError, match=r"'feedback' engine's process ended \(exit 5\)[\s\S]*gone"):
        dies()
    hangs = bench.EngineProcess(_fake_python(tmp_path, answers_once + "sleep 60\n"), {"name": "standard"},
                                dict(os.environ), tmp_path, "engine2", timeout=1.0)
    with pytest.raises(RuntimeError, match=r"'standard' engine's process answered nothing in 1 s"):
        hangs()
    assert hangs.proc.poll() is not None  # killed, not left running
    hangs.close()


def test_a_dying_engine_process_is_an_error_naming_it(tmp_path):
    """A child that exits before answering (here: a python that cannot run the side script's engine) ends the
    benchmark with its name and log tail at once."""
    fake = _fake_python(tmp_path, "echo 'no vllm here' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"'standard' engine's process ended \(exit 3\)[\s\S]*no vllm here"):
        bench.EngineProcess(fake, {"name": "standard"}, dict(os.environ), tmp_path, "engine0")
