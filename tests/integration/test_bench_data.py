"""benchmarks/bench_data.py --vs-datatrove end to end on a tiny corpus (skipped without the `bench` extra):
both tools run offline on the locally trained tokenizer.json, count the same tokens (the same work), and the
printed ratios are the quotients of the reported rates."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_vs_datatrove_runs_offline_and_compares_the_same_work(tmp_path):
    pytest.importorskip("datatrove")
    pytest.importorskip("orjson")
    out = tmp_path / "res.json"
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_data.py"), "--vs-datatrove",
                        "--corpus-mb", "0.3", "--vocab-size", "400", "--repeats", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["fbt"]["tokens"] == res["datatrove"]["tokens"] > 10_000
    assert [x["tool"] for x in res["runs"]] == ["fbt", "datatrove", "datatrove", "fbt"]  # alternating
    for stat in ("median", "best"):
        want = res["fbt"][f"{stat}_tokens_per_cpu_s"] / res["datatrove"][f"{stat}_tokens_per_cpu_s"]
        assert res[f"ratio_per_cpu_s_{stat}"] == pytest.approx(want, abs=1e-3)
    assert f"fbt / datatrove: {res['ratio_per_core_median']}x per core" in r.stdout
