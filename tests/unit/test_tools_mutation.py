"""tools/mutation.py (``make mutation FILE=...``): the map names files and tests that exist, the operator
set keeps one inverse per operator, and every listed equivalent mutant names a mapped file and a reason.
The tool itself runs cosmic-ray (not installed for CI); its runs are recorded in docs/results/benchmarks.md."""

import tomllib
from pathlib import Path

from tools.mutation import EQUIVALENTS, MAP, annotation_spans, excluded, in_annotation, mutated_line

ROOT = Path(__file__).resolve().parents[2]

CORE = ["model/feedback.py", "passes.py", "model/fbt_gpt.py", "train/run_lock.py", "checkpoint/manager.py",
        "checkpoint/rng.py", "hf/export.py", "hf/importer.py", "serving/vllm_model.py"]


def test_every_core_file_is_mapped_to_existing_tests():
    want = {f"fbt_megatron/{f}" for f in CORE} | {"data_pipeline/chat.py", "data_pipeline/loader.py"}
    assert want <= set(MAP)
    for file, spec in MAP.items():
        assert (ROOT / file).is_file(), file
        assert spec["tests"] and all((ROOT / t).is_file() for t in spec["tests"]), (file, spec)


def test_operators_kept_are_one_inverse_each():
    assert not excluded("core/ReplaceBinaryOperator_Add_Sub") and excluded("core/ReplaceBinaryOperator_Add_BitXor")
    assert not excluded("core/ReplaceComparisonOperator_Lt_LtE") and not excluded("core/ReplaceComparisonOperator_Eq_NotEq")
    assert excluded("core/ReplaceComparisonOperator_Lt_Is") and excluded("core/ReplaceComparisonOperator_Eq_Gt")
    for op in ("core/NumberReplacer", "core/AddNot", "core/ZeroIterationForLoop", "core/ReplaceTrueWithFalse"):
        assert not excluded(op), op


def test_a_one_line_diff_gives_the_line_before_and_after():
    diff = "--- a/x.py\n+++ b/x.py\n@@ -3 +3 @@\n-    if a < b:\n+    if a <= b:\n"
    assert mutated_line(diff) == ("if a < b:", "if a <= b:")
    # a removed decorator: cosmic-ray's diff also drops the blank lines and the comment above it
    diff = ("--- a/x.py\n+++ b/x.py\n@@ -181,10 +181,6 @@\n         view.copy_(got)\n-\n-\n-# --- weights only\n"
            "-@torch.no_grad()\n def load(path):\n")
    assert mutated_line(diff) == ("@torch.no_grad()", "")


def test_equivalent_mutants_name_a_mapped_file_the_lines_and_a_reason():
    entries = tomllib.loads(EQUIVALENTS.read_text())["mutant"]
    for e in entries:
        assert e["file"] in MAP and e["operator"].startswith("core/"), e
        assert e["before"] != e["after"] and len(e["reason"]) > 20, e
        assert e["before"] in {ln.strip() for ln in (ROOT / e["file"]).read_text().splitlines()}, e


def test_annotations_that_are_never_evaluated_are_not_mutated():
    code = "from __future__ import annotations\n\ndef f(a: int | None, b=1 | 2) -> str | None:\n    x: int | None = a\n"
    spans = annotation_spans(code)
    assert in_annotation((3, 13), spans) and in_annotation((3, 37), spans) and in_annotation((4, 11), spans)
    assert not in_annotation((3, 25), spans)  # 1 | 2, a default value, runs
    assert annotation_spans(code.split("\n", 1)[1]) == []  # evaluated without the __future__ import
