"""Bad input to the ``fbt`` commands, as a careless user gives it: each case asserts the one sentence the
user sees (no traceback, the file and the recipe key named), the exit status 2, and that nothing was
lost (inputs unchanged, nothing half-written). ``fbt -v`` still shows the traceback.

docs/reliability.md lists every bad input and fault with what the user sees and what is kept.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron import logs
from fbt_megatron.cli import main
from tests.support.generate_helpers import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu", OMP_NUM_THREADS="1")


def _digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) with its sha256: 'nothing lost' is equality."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _one_sentence(err: str, prefix: str) -> str:
    """The stderr of a refused command: exactly one error line, starting with ``prefix``, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(prefix)]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.fixture
def reset_logging():
    yield
    logs.setup("INFO")  # main(["-v", ...]) set DEBUG: leave the default behind


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _pipeline_recipe(tmp_path: Path, tokenizer: Path, source: Path) -> Path:
    recipe = {
        "name": "bad-data", "run_dir": str(tmp_path / "run"),
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 320,
                  "max_sequence_length": 16},
        "parallel": {"tensor": 1, "zero_stage": 0}, "batch": {"global_batch_size": 2, "micro_batch_size": 1},
        "data": {"source": "pipeline", "seq_length": 16,
                 "pipeline": {"sources": [{"name": "web", "path": str(source), "weight": 1.0}],
                              "tokenizer": str(tokenizer)}},
        "train": {"steps": 2}, "logging": {"tensorboard": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def test_missing_data_path_under_torchrun_is_one_sentence_from_rank0(tmp_path, tokenizer):
    """Two torchrun workers, a source directory that does not exist: rank 0 says so once, naming the
    recipe key and the path; no worker prints a traceback (nor a ``[rankN]:`` line); each exits 2."""
    missing = tmp_path / "datasets" / "web"
    recipe = _pipeline_recipe(tmp_path, tokenizer, missing)
    before = _digest(tokenizer) | _digest(recipe)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fbt_megatron.cli", "train", str(recipe)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    said = [line for line in out.splitlines() if line.startswith("fbt train: error:")]
    assert len(said) == 1, out[-5000:]
    assert "data.pipeline.sources[0].path" in said[0] and str(missing) in said[0], said
    assert out.count(str(missing)) == 1, out[-5000:]  # the message once, not once per rank
    assert not [line for line in out.splitlines() if line.startswith("[rank")], out[-5000:]
    frames = [line for line in out.splitlines() if line.strip().startswith("File ") and "/torch/" not in line
              and "<frozen" not in line]
    assert frames == [], out[-5000:]  # torchrun's own traceback (its ChildFailedError) only
    # torchrun's own summary of its workers: each exited 2 (a user error), unless torchrun stopped it
    # (SIGTERM) after the first one ended; torchrun itself exits 1
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
    assert 2 in codes and set(codes) <= {2, -15} and proc.returncode == 1, out[-3000:]
    assert _digest(tokenizer) | _digest(recipe) == before and not missing.exists()


def test_yaml_syntax_error_names_the_recipe_file_and_line(tmp_path, capsys, reset_logging):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 64\n  num_layers: [1, 2\ntrain: {steps: 3}\n")
    before = _digest(tmp_path)
    assert main(["train", str(bad)]) == 2
    line = _one_sentence(capsys.readouterr().err, "fbt train: error:")
    assert f"{bad}:4:" in line and "line 3" in line and "<unicode string>" not in line, line
    assert _digest(tmp_path) == before  # nothing written, not even a run directory
    # -v: the traceback too, then the same sentence
    assert main(["-v", "train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == line, err
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in _one_sentence(capsys.readouterr().err, "fbt train: error:")


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "hidden_act": "silu"}


def _hf_dir(root: Path, config_text: str, truncate: bool) -> Path:
    import torch
    from safetensors.torch import save_file

    root.mkdir()
    (root / "config.json").write_text(config_text)
    save_file({"model.embed_tokens.weight": torch.randn(64, 32), "lm_head.weight": torch.randn(64, 32)},
              str(root / "model.safetensors"))
    if truncate:
        data = (root / "model.safetensors").read_bytes()
        (root / "model.safetensors").write_bytes(data[: len(data) // 2])
    return root


@pytest.mark.parametrize("case", ["config_not_json", "truncated_safetensors"])
def test_from_hf_names_the_bad_file_and_writes_nothing(case, tmp_path, capsys):
    if case == "config_not_json":
        hf = _hf_dir(tmp_path / "hf", '{"model_type": "llama",\n  "hidden_size": 32,,\n}', truncate=False)
        expect = f"{hf / 'config.json'}:2:"
    else:
        hf = _hf_dir(tmp_path / "hf", json.dumps(LLAMA), truncate=True)
        expect = f"{hf / 'model.safetensors'}: not a readable safetensors file"
    before = _digest(hf)
    out = tmp_path / "imported"
    assert main(["convert", "from-hf", str(hf), str(out)]) == 2
    line = _one_sentence(capsys.readouterr().err, "fbt convert: error:")
    assert expect in line, line
    assert _digest(hf) == before and not out.exists()


def test_out_under_a_regular_file_is_refused_and_the_file_kept(tmp_path, tokenizer, capsys):
    """``--out`` whose parent is a regular file: one sentence naming that file; the file is unchanged."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "hello world"}\n{"text": "more words here"}\n')
    blocker = tmp_path / "notes.txt"
    blocker.write_text("my notes\n")
    before = _digest(tmp_path)
    assert main(["data", "prepare", "--input", str(raw), "--tokenizer", str(tokenizer),
                 "--out", str(blocker / "dataset")]) == 2
    line = _one_sentence(capsys.readouterr().err, "fbt data: error:")
    assert f"{blocker} is a file, not a directory" in line, line
    assert _digest(tmp_path) == before


def _can_bind_read_only() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind / /mnt && mount -o remount,bind,ro /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_bind_read_only(), reason="needs unshare and mount (a private read-only bind mount)")
def test_out_on_a_read_only_filesystem_is_one_sentence(tmp_path, tokenizer):
    """A real read-only filesystem: ``--out`` on a read-only bind mount (in a private mount namespace, so
    nothing outside the test sees it). Root ignores chmod, hence the mount."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "hello world"}\n{"text": "more words here"}\n')
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "kept.txt").write_text("kept\n")
    before = _digest(tmp_path)
    script = (f"mount --bind {tmp_path / 'ro'} {tmp_path / 'ro'} && mount -o remount,bind,ro {tmp_path / 'ro'} && "
              f"exec {sys.executable} -m fbt_megatron.cli data prepare --input {raw} --tokenizer {tokenizer} "
              f"--out {tmp_path / 'ro' / 'dataset'}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_sentence(proc.stderr, "fbt data: error:")
    assert str(tmp_path / "ro") in line and "Read-only file system" in line, line
    assert _digest(tmp_path) == before


def test_read_only_error_in_process_is_one_sentence(tmp_path, capsys, monkeypatch):
    """The same report where no mount is possible: an EROFS raised where the output directory is made
    (simulated; the test above uses a real read-only filesystem)."""
    from fbt_megatron.errors import user_error_message

    err = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "out"))
    assert user_error_message(err) == f"{tmp_path / 'out'}: Read-only file system"
    assert user_error_message(OSError(errno.EIO, "I/O error", "x")) is None  # not the user's to fix: traceback
    assert user_error_message(ValueError("a bug")) is None


@pytest.fixture
def tiny_run(tmp_path, single_process):
    from tests.support.generate_helpers import save_run

    tok = make_tokenizer(tmp_path)
    save_run(tmp_path / "run", tok)
    return tmp_path / "run"


def test_prompt_longer_than_the_context_is_refused_or_truncated_left(tiny_run, capsys):
    """The tiny model's context is 96 tokens: with --max-new-tokens 8 a prompt may have 89. A longer one
    is refused before anything is generated, naming the numbers and ``--truncate left``; with it, the
    completion is the one of the prompt's last 89 tokens."""
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.generate.sampling import SamplingParams

    prompt = "x = 1 + 2\nprint(x)\n" * 30
    before = _digest(tiny_run)
    argv = ["generate", str(tiny_run), "--prompt", prompt, "--max-new-tokens", "8", "--json"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_sentence(captured.err, "fbt generate: error:")
    assert "prompt 1 has" in line and "context of 96 tokens" in line and "--truncate left" in line, line
    assert captured.out == ""

    assert main([*argv, "--truncate", "left"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gen = TextGenerator.from_checkpoint(tiny_run)
    ids = gen.encode(prompt)
    assert len(ids) > 89
    want = gen.generate([prompt], SamplingParams(max_new_tokens=8), prompt_ids=[ids[-89:]])[0]
    assert row["completion"] == want.text and row["tokens"] == len(want.tokens)
    assert main([*argv[:-3], "--max-new-tokens", "200"]) == 2  # no room at all, even truncated
    assert "leaves no room for a prompt" in _one_sentence(capsys.readouterr().err, "fbt generate: error:")
    assert _digest(tiny_run) == before
