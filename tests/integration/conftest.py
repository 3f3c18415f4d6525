"""The integration tier: every test here is marked ``slow`` (left out of ``make test-fast``).

What lives here: tests that start processes (run_distributed's gloo ranks, torchrun, the CLI or a tool as a
subprocess), use the local SLURM cluster, vLLM's venv or other transformers versions, or build the wheel.
``make test`` runs them with the unit tier; tests/conftest.py's fixtures serve both."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
