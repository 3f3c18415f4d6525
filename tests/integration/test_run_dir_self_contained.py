"""A run directory is self-contained: every checkpoint keeps the run's tokenizer, so `fbt generate` /
`fbt eval` work from any directory even when the recipe named the tokenizer by a path relative to
where training ran."""

from __future__ import annotations

import json
import shutil

from tests.support.data_fixtures import build_fixture, fixture_config
from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn


def test_checkpoint_keeps_the_tokenizer(tmp_path, monkeypatch, single_process):
    fx = build_fixture(tmp_path / "data")
    here = tmp_path / "train_here"
    here.mkdir()
    shutil.copyfile(fx["tokenizer"], here / "tok.model")
    section = fixture_config(fx, seq_length=32).model_dump(mode="json")
    section["tokenizer"] = "tok.model"  # relative to the directory training runs in
    run_dir = tmp_path / "runs" / "x"
    recipe = tiny_recipe(run_dir, data={"source": "pipeline", "pipeline": section}, model={"vocab_size": 320},
                         train={"steps": 2}, checkpoint={"at_end": True}, eval={"at_end": False})
    monkeypatch.chdir(here)
    run_distributed(train_fn, 1, recipe)

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "tokenizer.model").read_bytes() == (here / "tok.model").read_bytes()
    assert "tokenizer.model" in json.loads((ckpt / "manifest.json").read_text())["files"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    from data_pipeline.tokenizer import load_tokenizer
    from fbt_megatron.generate.loading import load_for_inference

    loaded = load_for_inference(run_dir)
    text = "def add(a, b): return a + b"
    assert loaded.tokenizer.encode(text) == load_tokenizer(fx["tokenizer"]).encode(text)

    # `fbt convert to-hf` from elsewhere exports the tokenizer the checkpoint keeps
    from fbt_megatron.hf.export import export_checkpoint
    from transformers import AutoTokenizer

    out = export_checkpoint(run_dir, elsewhere / "hf", log=lambda *a, **k: None, progress=False)
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok(text)["input_ids"][-len(loaded.tokenizer.encode(text)):] == loaded.tokenizer.encode(text)
