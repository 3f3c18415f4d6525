"""Which attention runs in fp32 on Transformer Engine: TE 2.11 and later run packed (THD) documents on the
unfused backend (TE 2.10 disables that backend for qkv_format thd), so fp32 keeps packed documents there
and falls back to the dense document mask before it."""

import torch

from fbt_megatron.model import attention
from fbt_megatron.model.attention import attention_backend, te_unfused_runs_thd


def test_te_versions_that_run_thd_unfused():
    for version, runs in (("2.10.0", False), ("2.9.0", False), ("2.11.0", True), ("2.12.0.dev0+abc123", True),
                          ("2.18", True), ("3.0.0", True), ("1.13.0", False), (None, False)):
        assert te_unfused_runs_thd(version) is runs, version


def test_fp32_keeps_packed_documents_where_te_runs_them():
    fp32 = torch.float32
    assert attention_backend(True, "document_causal", fp32, "2.11.0") == "packed-unfused"
    assert attention_backend(True, "document_causal", fp32, "2.10.1") == "unfused"  # the dense mask
    assert attention_backend(True, "document_causal", fp32) == "unfused"  # version unknown: the dense mask
    assert attention_backend(True, "causal", fp32, "2.11.0") == "unfused"  # one causal row: no documents
    for dtype in (torch.bfloat16, torch.float16):  # flash/fused run THD whatever the version
        assert attention_backend(True, "document_causal", dtype, "2.10.0") == "packed"
    assert attention_backend(False, "document_causal", fp32, "2.11.0") == "sdpa"


def test_the_model_reads_the_installed_te_version(monkeypatch):
    """``spec_backend`` asks the installed TE's version only for TE layers."""
    asked = []
    monkeypatch.setattr(attention, "installed_te_version", lambda: asked.append(1) or "2.11.0")
    monkeypatch.setattr(attention, "_uses_te_attention", lambda spec: spec == "te")
    assert attention.spec_backend("te", "document_causal", torch.float32) == "packed-unfused"
    assert attention.spec_backend("local", "document_causal", torch.float32) == "sdpa" and len(asked) == 1
    monkeypatch.setattr(attention, "installed_te_version", lambda: "2.10.0")
    assert attention.spec_backend("te", "document_causal", torch.float32) == "unfused"
