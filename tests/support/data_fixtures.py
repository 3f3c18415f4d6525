"""Small synthetic corpora for the data pipeline's tests and benchmark (deterministic, offline)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.prepare import prepare_dataset
from data_pipeline.tokenizer import train_tokenizer

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but "
         "have an they you were her she there been one all we their has would when if so no what up out "
         "model data token stream shard loader rank worker seed cursor batch sequence document river "
         "stone light garden window number seven twelve ninety").split()


def _text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if rng.random() < 0.08:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines)


def write_corpus(root: Path, seed: int = 0, sizes=(120, 60, 200)) -> dict[str, list[tuple[str, str]]]:
    """Three raw sources under ``root``: ``web`` (JSONL, with one empty record), ``code`` (a directory of
    text files) and ``math`` (JSONL). Returns the non-empty documents of each, in reading order."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs: dict[str, list[tuple[str, str]]] = {"web": [], "code": [], "math": []}
    with open(root / "web.jsonl", "w") as f:
        for i in range(sizes[0]):
            text = _text(rng, rng.choice([5, 20, 60, 150, 400]))
            if i == 7:
                text = "   "  # an empty document: skipped and counted
            f.write(json.dumps({"id": f"w{i}", "text": text}) + "\n")
            if text.strip():
                docs["web"].append((f"w{i}", text))
    (root / "code").mkdir(exist_ok=True)
    for i in range(sizes[1]):
        body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {rng.randint(0, 99)}" for j in range(rng.randint(1, 30)))
        p = root / "code" / f"m{i:03d}.py"
        p.write_text(body)
        docs["code"].append((str(p), body))
    with open(root / "math.jsonl", "w") as f:
        for i in range(sizes[2]):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            text = f"Question: what is {a} plus {b}?\nAnswer: {a} + {b} = {a + b}.\n#### {a + b}"
            f.write(json.dumps({"id": f"m{i}", "text": text}) + "\n")
            docs["math"].append((f"m{i}", text))
    return docs


def build_fixture(root: Path, *, vocab_size: int = 320, shard_bytes: int = 20000, seed: int = 0) -> dict:
    """Corpus + tokenizer + three prepared datasets with several small shards each."""
    root = Path(root)
    docs = write_corpus(root / "raw", seed)
    tok = root / "tok.model"
    train_tokenizer([t for v in docs.values() for _, t in v], tok, vocab_size=vocab_size, num_threads=1)
    inputs = {"web": [str(root / "raw" / "web.jsonl")], "code": [str(root / "raw" / "code")],
              "math": [str(root / "raw" / "math.jsonl")]}
    for name, paths in inputs.items():
        prepare_dataset(paths, root / name, tok, name=name, shard_bytes=shard_bytes, num_workers=1, progress=False)
    return {"root": root, "docs": docs, "tokenizer": str(tok)}


def fixture_config(fx: dict, *, weights=(0.5, 0.2, 0.3), seq_length: int = 32, **kw) -> DataConfig:
    return DataConfig(
        sources=[SourceConfig(name=n, path=str(fx["root"] / n), weight=w) for n, w in zip(("web", "code", "math"), weights)],
        tokenizer=fx["tokenizer"], seq_length=seq_length, **kw)


def global_stream(cfg: DataConfig, steps: int, dp: int = 1, *, gb: int = 8, mb: int = 2, **loader_kw):
    """Run ``dp`` rank loaders for ``steps`` global steps; concatenate the ranks' shares in global
    order (rank r's block is block r of each global batch). Returns (tensors by key, the loaders)."""
    import torch

    from data_pipeline.loader import build_loader

    loaders = [build_loader(cfg, micro_batch_size=mb, global_batch_size=gb, dp_rank=r, dp_size=dp, **loader_kw)
               for r in range(dp)]
    out: dict[str, list] = {}
    for _ in range(steps):
        for ld in loaders:
            for _ in range(ld.micro_batches_per_step):
                for k, v in next(ld).items():
                    if k not in ("cu_seqlens", "max_seqlen"):  # the [B, S] tensors (their documents: test_packed_documents)
                        out.setdefault(k, []).append(v)
    for ld in loaders:
        ld.close()
    return {k: torch.cat(v) for k, v in out.items()}, loaders


def assert_same_batches(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


def train_hf_bpe(texts, out_dir: Path, vocab_size: int = 300, config: bool = True) -> Path:
    """A Hugging Face byte-level BPE ``tokenizer.json`` trained by ``tokenizers`` on ``texts`` (Llama 3's
    special tokens ``<|begin_of_text|>``, ``<|end_of_text|>``), in ``out_dir`` with a ``tokenizer_config.json``
    naming them (``config=False``: the bare tokenizer.json). Returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tk.train_from_iterator(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    if config:
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": specials[0], "eos_token": specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out_dir
