"""Test support, shared by the test modules and not shipped in the wheel: fixtures and helpers, the test
entry points that tests start as processes (``python -m tests.support.training``, ``slow_save``,
``hold_prepare``: run from the repository root) and, under ``side/``, the scripts that run in another
environment (an HF-only process, the vLLM venv) by path."""

from pathlib import Path

SIDE_SCRIPTS = Path(__file__).resolve().parent / "side"
