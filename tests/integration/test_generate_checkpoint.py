"""Generation from saved checkpoints: a TP=2 checkpoint generated with TP=2 and with TP=1 gives
the same tokens and logits; the text API and ``fbt generate`` run from a run directory."""

import pytest
import torch

from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import run_distributed
from tests.support.generate_helpers import make_tokenizer, save_run

PROMPTS = ["def add(a, b):", "x = 1", "Question: what is 3 plus 4?\nAnswer:"]


def _generate(run_dir, tokenizer, save):
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.generate.sampling import SamplingParams

    if save:
        save_run(run_dir, tokenizer)
    gen = TextGenerator.from_checkpoint(run_dir, mode="feedback", prefill_passes=2)
    encoded = [gen.encode(p) for p in PROMPTS]
    out = gen.decoder.generate(encoded, SamplingParams(max_new_tokens=8), return_logits=True)
    sampled = gen.decoder.generate(encoded, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5))
    return out.tokens, out.logits, sampled.tokens


def test_tp2_checkpoint_generates_like_tp1(tmp_path):
    tok = make_tokenizer(tmp_path)
    run = tmp_path / "run"
    tp2 = run_distributed(_generate, 2, run, tok, True, layout=ParallelLayout(tensor=2))
    assert tp2[0][0] == tp2[1][0] and tp2[0][2] == tp2[1][2]  # both TP ranks drew the same tokens
    (tp1,) = run_distributed(_generate, 1, run, tok, False, layout=ParallelLayout(tensor=1))
    assert tp1[0] == tp2[0][0]
    assert tp1[2] == tp2[0][2]  # sampling too: the padded vocabulary (384 vs 512 rows) is cut off
    assert tp1[1].shape[-1] == 320  # the logical vocabulary
    torch.testing.assert_close(tp1[1], tp2[0][1], rtol=1e-5, atol=1e-5)


def test_text_api_and_cli(tmp_path, single_process, capsys):
    from fbt_megatron.cli import main
    from fbt_megatron.generate.api import TextGenerator, cut_at_stop
    from fbt_megatron.generate.sampling import SamplingParams

    tok = make_tokenizer(tmp_path)
    save_run(tmp_path / "run", tok)
    gen = TextGenerator.from_checkpoint(tmp_path / "run")
    free = gen.generate(["x = 1"], SamplingParams(max_new_tokens=12))[0]
    assert free.finish_reason in ("length", "eos") and gen.decode(free.tokens).startswith(free.text)
    # a stop string that the free run produces ends generation there; the stream shows exactly the text
    assert len(free.text) > 3, free  # the precondition of the stop-string check below
    stop = free.text[2:4]
    pieces = []
    cut = gen.generate(["x = 1"], SamplingParams(max_new_tokens=12, stop=[stop]),
                       stream=lambda b, delta: pieces.append(delta))[0]
    assert cut.finish_reason == "stop" and cut.text == cut_at_stop(free.text, [stop])[0]
    assert "".join(pieces) == cut.text
    assert cut_at_stop("abc\ndef\nxyz", ["\nx", "\nd"]) == ("abc", True)

    rc = main(["generate", str(tmp_path / "run"), "--prompt", "x = 1", "--max-new-tokens", "12", "--json"])
    assert rc == 0
    import json

    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["completion"] == free.text and row["prompt"] == "x = 1"
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
