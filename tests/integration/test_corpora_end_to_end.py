"""Issue 43's path for a user with a Llama 3.2 checkpoint and their own corpus, offline, through the four
README commands (`fbt data prepare`, `fbt convert from-hf`, `fbt train`, `fbt convert to-hf`):
transformers builds a small Llama-3.2-shaped model (llama3 RoPE scaling, GQA, tied embeddings) and
`tokenizers` trains a byte-level BPE tokenizer.json on embedded text; the corpus is a Parquet file and
a .jsonl.zst file. Before training the imported model's standard mode is the stock model (logits);
after a few feedback-phase steps the export generates with transformers, and its tokenizer gives the
original tokenizer's ids."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.data_fixtures import WORDS, train_hf_bpe

REPO = Path(__file__).resolve().parents[2]
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + i % 17)) + f". {i * 37} + {i} = {i * 38}\n"
         for i in range(80)]


def fbt(*args, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "-q", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fbt {' '.join(map(str, args))}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _llama32(path: Path, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _corpus(root: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir()
    pq.write_table(pa.table({"text": TEXTS[:50]}), root / "web.parquet", row_group_size=16)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[50:]).encode()
    (root / "code.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    return [root / "web.parquet", root / "code.jsonl.zst"]


def test_llama_checkpoint_feedback_phase_on_own_corpus(tmp_path, single_process):
    from transformers import PreTrainedTokenizerFast

    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.model.modeling_fbt import FBTForCausalLM

    hf = train_hf_bpe(TEXTS, tmp_path / "llama", vocab_size=320)
    original = PreTrainedTokenizerFast.from_pretrained(str(hf))
    stock = _llama32(hf, len(original))
    inputs = _corpus(tmp_path / "corpus")

    fbt("data", "prepare", "--input", *inputs, "--tokenizer", hf, "--out", tmp_path / "data" / "mine",
        "--workers", 1, cwd=tmp_path)
    fbt("convert", "from-hf", hf, tmp_path / "run", cwd=tmp_path)
    ids = torch.tensor([original.encode(TEXTS[3], add_special_tokens=False)[:24]])
    with torch.no_grad():  # before training: the imported model's standard mode is the stock Llama
        theirs = stock(ids).logits
        ours = load_framework_model(tmp_path / "run")(ids, num_passes=1).logits[..., : theirs.shape[-1]]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-5

    data = f"{{sources: [{{name: mine, path: {tmp_path / 'data' / 'mine'}, weight: 1}}], tokenizer: {hf}}}"
    fbt("train", tmp_path / "run" / "recipe.yaml", "data.source=pipeline", f"data.pipeline={data}",
        "data.seq_length=32", "batch.global_batch_size=2", "batch.micro_batch_size=2", "train.steps=3",
        "schedule.mix=[0.0, 0.5, 0.5]", "eval.at_end=false", "logging.tensorboard=false", cwd=tmp_path)
    fbt("convert", "to-hf", tmp_path / "run", tmp_path / "export", cwd=tmp_path)

    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["tie_word_embeddings"]
    assert config["fbt"]["steps"] == 3 and sum(v for k, v in config["fbt"]["pass_counts"].items() if k != "1") == 3
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "export"))
    for text in TEXTS[:5]:
        assert tok.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    # The tokenizer travels with every checkpoint: without the import's copy, to-hf writes the checkpoint's.
    from fbt_megatron.hf.export import export_checkpoint

    ckpt = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (ckpt / name).read_bytes() == (hf / name).read_bytes()
    (tmp_path / "run" / "hf_import").rename(tmp_path / "moved")
    export_checkpoint(tmp_path / "run", tmp_path / "export2", log=lambda *a: None)
    assert (tmp_path / "export2" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    again = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "export2"))
    assert again.eos_token == "<|end_of_text|>" and again.encode(TEXTS[7]) == original.encode(TEXTS[7])

    model = FBTForCausalLM.from_pretrained(tmp_path / "export").eval()  # the export's modelling file
    prompt = tok(TEXTS[0][:30], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt.input_ids.shape[1] + 8 and tok.decode(out[0])
