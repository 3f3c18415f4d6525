"""The CPU fast paths live in one room (fbt_megatron/model/cpu_fastpaths.py), installed only on CPU.

- No module of the package but the room assigns an attribute on a module or class imported from
  megatron, deepspeed or transformer_engine (an AST scan of ``fbt_megatron/**/*.py``).
- Building a model on another device, or on CPU with ``FBT_CPU_FASTPATHS=0``, leaves every lookup point
  the room replaces holding the library's own object; on CPU the shortcuts are installed; with library
  versions other than ``CHECKED_VERSIONS`` nothing is installed and a warning names both versions.
- The one version pin of the shortcuts: the installed libraries are the versions they were checked against.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from fbt_megatron import runtime
from fbt_megatron.model import cpu_fastpaths as room
from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import feedback, tiny_model_config

ROOT = Path(__file__).resolve().parents[2]  # tests/unit/ -> the repository root
LIBRARIES = ("megatron", "deepspeed", "transformer_engine")
ROOM = ROOT / "fbt_megatron" / "model" / "cpu_fastpaths.py"


# ------------------------------------------------------------------------------------------ the AST scan
def _library_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from the libraries (anywhere in it, functions included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(expr: ast.AST) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _targets(node: ast.AST):
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    elif isinstance(node, ast.Delete):
        pending = list(node.targets)
    else:
        pending = []
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        elif isinstance(target, ast.Attribute):
            yield target.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
            and node.args):
        yield node.args[0]


def library_attribute_assignments(source: str) -> list[tuple[int, str]]:
    """(line, code) of every assignment, deletion or setattr/delattr of an attribute on a name imported
    from megatron, deepspeed or transformer_engine (or on an attribute path below one)."""
    tree = ast.parse(source)
    names = _library_names(tree)
    return [(node.lineno, ast.unparse(node).splitlines()[0]) for node in ast.walk(tree)
            for obj in _targets(node) if _root(obj) in names]


def test_the_scan_finds_each_form():
    source = """
import megatron.core.tensor_parallel
import deepspeed as ds
from megatron.core.transformer import attention as megatron_attention
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

def f(config):
    megatron.core.tensor_parallel.vocab_parallel_cross_entropy = None
    megatron_attention.apply_rotary_pos_emb = None
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(max)
    setattr(megatron_attention, "apply_rotary_pos_emb", None)
    a, ds.comm.all_reduce = 1, None
    def g():
        from transformer_engine.pytorch import attention as te
        te.x += 1
    config.apply_rope_fusion = True  # an instance passed in: not a library attribute
"""
    assert [line for line, _ in sorted(library_attribute_assignments(source))] == [8, 9, 10, 11, 12, 15]


# Outside the room, by file: the code that may assign a library attribute, and why. Correctness, not speed:
# Megatron's layers need these to run on CPU at all, whatever FBT_CPU_FASTPATHS says (runtime.install_cpu_shims:
# an RNG tracker without CUDA generators, recompute without a CUDA generator to save).
ALLOWED = {
    "fbt_megatron/runtime.py": {
        "mp_random._CUDA_RNG_STATE_TRACKER = tracker_cls()",
        "mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True",
        "mp_random.initialize_rng_tracker = lambda *a, **k: None",
        "mp_random._get_cuda_rng_state = lambda *a, **k: None",
        "mp_random._set_cuda_rng_state = lambda *a, **k: None",
    },
}


def test_only_the_room_replaces_library_attributes():
    paths = sorted((ROOT / "fbt_megatron").rglob("*.py"))
    assert ROOM in paths, f"the scan must see the package's source (looked under {ROOT / 'fbt_megatron'})"
    found = []
    for path in paths:
        if path == ROOM:
            continue
        name = str(path.relative_to(ROOT))
        found += [f"{name}:{line}: {code}" for line, code in library_attribute_assignments(path.read_text())
                  if code not in ALLOWED.get(name, ())]
    assert not found, ("only fbt_megatron/model/cpu_fastpaths.py may replace a Megatron/DeepSpeed/TE "
                       "attribute:\n" + "\n".join(found))


# ------------------------------------------------------------------------------------------ at run time
def lookups_hold(which: str) -> bool:
    """Whether every lookup point holds the library's own object ("stock") or the room's ("ours")."""
    return all(getattr(module, attribute) is (stock if which == "stock" else ours)
               for points in room.LOOKUPS.values() for module, attribute, stock, ours in points)


@pytest.fixture
def room_state():
    """The room back to what a CPU model build gives after the test."""
    yield
    room.install("cpu")


def test_not_installed_off_the_cpu(single_process, monkeypatch, room_state):
    """A model built for another device (the meta device, which every machine has, standing in for CUDA)
    leaves every lookup point Megatron's, even after a CPU build installed them in this process."""
    build_model(tiny_model_config(), feedback())
    assert lookups_hold("ours") and room.active()
    monkeypatch.setattr(runtime, "device", lambda: torch.device("meta"))
    model = build_model(tiny_model_config(), feedback())
    assert next(model.parameters()).device.type == "meta"
    assert lookups_hold("stock") and not room.active()
    assert room.one_rank_cross_entropy(torch.zeros(2, 1, 4), torch.zeros(2, 1, dtype=torch.long)) is None


def test_switched_off_on_cpu(single_process, monkeypatch, room_state):
    room.install("cpu")
    monkeypatch.setenv(room.ENV, "0")
    build_model(tiny_model_config(), feedback())
    assert lookups_hold("stock") and not room.active()


def test_installed_on_cpu(single_process, room_state):
    room.uninstall()
    build_model(tiny_model_config(), feedback())
    assert lookups_hold("ours") and all(room.active(name) for name in room.SHORTCUTS)
    with room.disabled():
        assert lookups_hold("stock") and not room.active()
    assert lookups_hold("ours")


def test_a_version_mismatch_installs_nothing_and_warns_once(single_process, monkeypatch, room_state):
    room.install("cpu")
    monkeypatch.setitem(room.CHECKED_VERSIONS, "megatron-core", ("0.0.1", "0.0.2"))
    monkeypatch.setattr(room, "_warned", False)
    have = room._base_version("megatron-core")
    with pytest.warns(RuntimeWarning, match=rf"megatron-core {have} \(checked: 0\.0\.1 or 0\.0\.2\)"):
        build_model(tiny_model_config(), feedback())
    assert lookups_hold("stock") and not room.active()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not room.install("cpu")  # once
    assert lookups_hold("stock")


def test_installed_versions_are_the_checked_ones():
    """The one pin of every shortcut (and of their equality tests): an upgrade of megatron-core or torch
    runs the stock path until the shortcuts are checked again and CHECKED_VERSIONS says so."""
    assert room.version_mismatches() == {}, (
        "re-check fbt_megatron/model/cpu_fastpaths.py against the installed versions (its tests and "
        "benchmarks/bench_cpu_fastpaths.py), then update CHECKED_VERSIONS")
