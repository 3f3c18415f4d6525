"""Instruction tuning (issue 22): `task: sft` from an FBT checkpoint or an HF import (weights only,
fresh optimiser and schedule); the chat loss mask in every layout (DP, TP, PP) — the same losses and the
same count of loss tokens, which is the mask's count, not the batch's; a resume mid-SFT continues
exactly (parameters compared); the exported chat template renders the ids of `fbt generate --chat`."""

import json
import subprocess
import sys

import pytest
import torch

from tests.support.chat_helpers import build_chat_fixture, chat_data_section, checkpoint_params, sft_recipe, sft_train_fn, stock_llama
from tests.support.distributed import run_distributed
from tests.support.training import losses, read_metrics, tiny_recipe, train_fn

TOL = 1e-5


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_chat_fixture(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def base(fx, tmp_path_factory):
    """A pretrained tiny FBT run on plain text with the same tokenizer: what SFT starts from."""
    run = tmp_path_factory.mktemp("base")
    r = tiny_recipe(run, data={"source": "pipeline", "pipeline": chat_data_section(fx, name="text")},
                    model={"vocab_size": 512, "max_sequence_length": 64}, train={"steps": 3}, checkpoint={"at_end": True})
    run_distributed(train_fn, 1, r)
    return run


@pytest.fixture(scope="module")
def reference(fx, base, tmp_path_factory):
    """SFT at DP=1 for 4 steps, with the state before and after every step."""
    run = tmp_path_factory.mktemp("sft_ref")
    r = sft_recipe(run, fx, base, train={"steps": 4}, checkpoint={"at_end": True})
    return run, run_distributed(sft_train_fn, 1, r, "step_states")[0]


def expected_loss_tokens(fx, steps: int) -> list[int]:
    """Loss tokens of each global batch (8 sequences) of the SFT stream: the chat mask's count."""
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import build_loader

    loader = build_loader(DataConfig(**chat_data_section(fx)), micro_batch_size=8, global_batch_size=8,
                          dp_rank=0, dp_size=1)
    out = []
    for _ in range(steps):
        b = next(loader)
        out.append(int(b["loss_mask"].sum()))
        assert out[-1] < 0.5 * int((b["input_ids"] != 2).sum())  # far fewer than the non-EOS tokens
    return out


def tokens_per_step(run) -> list[int]:
    seen = [r["tokens_seen"] for r in read_metrics(run)]
    return [b - a for a, b in zip([0] + seen, seen)]


def test_sft_starts_from_the_checkpoints_weights_with_a_fresh_optimiser(fx, base, reference):
    _, summary = reference
    initial = summary["probe"]["initial"]
    want = run_distributed(checkpoint_params, 1, str(base))[0]
    assert set(initial["params"]) == set(want)
    for name, p in want.items():
        assert torch.equal(initial["params"][name], p), name
    assert initial["adam_step"] == 0  # the base run's 3 optimiser steps are not carried over
    assert all(float(m.abs().max()) == 0 for m in initial["exp_avg"].values())
    assert summary["history"][0][0] == 0 and len(summary["history"]) == 4  # a new schedule, from step 0
    assert (reference[0] / "checkpoints" / "step_00000004" / "chat_template.jinja").read_text() == fx["template"]
    assert not (reference[0] / "chat_template.jinja").exists()  # the run directory's top is the user's


@pytest.mark.parametrize("world,parallel", [
    (2, {"zero_stage": 1}),
    (2, {"tensor": 2}),
    (2, {"pipeline": 2}),
], ids=["dp2", "tp2", "pp2"])
def test_the_chat_loss_mask_survives_every_layout(fx, base, reference, tmp_path, world, parallel):
    ref_run, ref = reference
    want_tokens = expected_loss_tokens(fx, 4)
    assert tokens_per_step(ref_run) == want_tokens
    r = sft_recipe(tmp_path, fx, base, train={"steps": 4}, parallel=parallel)
    got = run_distributed(sft_train_fn, world, r)[0]
    assert tokens_per_step(tmp_path) == want_tokens
    assert [h[1] for h in got["history"]] == [h[1] for h in ref["history"]]
    assert losses(got) == pytest.approx(losses(ref), abs=TOL)


def test_resume_mid_sft_continues_exactly(fx, base, reference, tmp_path):
    _, ref = reference
    first = sft_recipe(tmp_path, fx, base, train={"steps": 4, "stop_at_step": 2}, checkpoint={"at_end": True})
    run_distributed(sft_train_fn, 1, first)
    resumed = run_distributed(sft_train_fn, 1, sft_recipe(tmp_path, fx, base, train={"steps": 4}), "final_params")[0]
    assert resumed["history"][0][0] == 2
    final = ref["probe"][3]["params"]  # after the last step (steps 0..3)
    for name, p in resumed["probe"].items():
        assert torch.equal(p, final[name]), name  # bit for bit: the same run, interrupted
    assert losses(resumed) == pytest.approx(losses(ref)[2:], abs=TOL)


def test_a_resume_takes_the_model_from_the_runs_own_checkpoint_not_init_from(fx, base, tmp_path):
    import shutil

    from fbt_megatron.checkpoint.manager import read_checkpoint_state

    start = tmp_path / "start"
    shutil.copytree(base, start)
    recipe = sft_recipe(tmp_path / "sft", fx, start, train={"steps": 2, "stop_at_step": 1}, checkpoint={"at_end": True})
    del recipe["model"]  # from init_from at the start, from the run's own checkpoint on the resume
    run_distributed(sft_train_fn, 1, recipe)
    shutil.rmtree(start)  # init_from is gone: a resume does not read it again
    del recipe["train"]["stop_at_step"]
    out = run_distributed(sft_train_fn, 1, recipe)[0]
    assert out["history"][0][0] == 1 and len(out["history"]) == 1
    assert read_checkpoint_state(tmp_path / "sft")["recipe"]["model"] == read_checkpoint_state(base)["recipe"]["model"]


def test_sft_from_an_hf_import(fx, tmp_path):
    stock_llama(tmp_path / "llama")
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "-q", "convert", "from-hf", str(tmp_path / "llama"),
                        str(tmp_path / "imported")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    recipe = sft_recipe(tmp_path / "sft", fx, tmp_path / "imported", train={"steps": 2})
    del recipe["model"]  # the import's architecture (Llama-class blocks) comes with init_from
    out = run_distributed(sft_train_fn, 1, recipe, "step_states")[0]
    want = run_distributed(checkpoint_params, 1, str(tmp_path / "imported"))[0]
    initial = out["probe"]["initial"]["params"]
    assert set(initial) == set(want)
    for name, p in want.items():
        assert torch.equal(initial[name], p), name
    assert all(torch.isfinite(torch.tensor(x)) for x in losses(out))


def test_exported_chat_template_renders_the_ids_of_fbt_generate_chat(reference, tmp_path):
    run, _ = reference
    env_cmd = [sys.executable, "-m", "fbt_megatron.cli", "-q"]
    r = subprocess.run(env_cmd + ["generate", str(run), "--chat", "--system", "Be brief.", "--prompt", "3+4?",
                                  "--json", "--max-new-tokens", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout.strip().splitlines()[-1])["prompt_ids"]
    r = subprocess.run(env_cmd + ["convert", "to-hf", str(run), str(tmp_path / "hf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = (
        "import json, sys; from transformers import AutoTokenizer, pipeline\n"
        f"t = AutoTokenizer.from_pretrained({str(tmp_path / 'hf')!r}, trust_remote_code=True)\n"
        "msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '3+4?'}]\n"
        "ids = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)\n"
        f"p = pipeline('text-generation', model={str(tmp_path / 'hf')!r}, tokenizer=t, trust_remote_code=True)\n"
        "out = p(msgs, max_new_tokens=3, do_sample=False)\n"
        "print(json.dumps({'ids': list(ids), 'reply': out[0]['generated_text'][-1]}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert theirs["ids"] == ours
    assert theirs["reply"]["role"] == "assistant"  # transformers' chat pipeline ran the template
    r = subprocess.run(env_cmd + ["generate", str(run), "--system", "x", "--prompt", "y"], capture_output=True, text=True)
    assert r.returncode == 2 and "--system applies to --chat" in r.stderr


def test_generate_chat_echoes_the_rendered_prompt_streaming_or_not(reference):
    run, _ = reference
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "-q", "generate", str(run), "--chat", "--system", "Be brief.",
           "--prompt", "3+4?", "--max-new-tokens", "3"]
    rendered = "<|system|>\nBe brief.</s><|user|>\n3+4?</s><|assistant|>\n"
    for extra in ([], ["--no-stream"]):
        r = subprocess.run(cmd + extra, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(rendered), (extra, r.stdout)


def test_fbt_eval_applies_the_chat_template_and_pairs_lengths_per_problem(reference, tmp_path):
    from tests.unit.test_eval_lm_eval import write_tasks

    run, _ = reference
    tasks = write_tasks(tmp_path / "tasks")
    env = dict(__import__("os").environ, HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "-q", "eval", str(run), "--tasks",
                        str(tasks / "fbt_local_gen.yaml"), "--modes", "fused,standard", "--limit", "3",
                        "--apply-chat-template", "--system-instruction", "Be brief.", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    table = json.loads((tmp_path / "out" / "eval.json").read_text())["tasks"]["fbt_local_gen"]
    std, fused = table["standard"], table["fused"]
    assert len(std["tokens_by_problem"]) == 3 and set(std["tokens_by_problem"]) == set(fused["tokens_by_problem"])
    assert set(std["prompts_by_problem"]) == set(std["tokens_by_problem"])  # problems are request indices
    for prompt in std["prompts_by_problem"].values():  # lm-eval rendered each prompt with the run's chat template
        assert prompt.startswith("<|system|>\nBe brief.</s><|user|>\n") and prompt.endswith("</s><|assistant|>\n")
    assert std["mean_tokens"] == pytest.approx(sum(std["tokens_by_problem"].values()) / 3, abs=0.01)
    pair = fused["paired_with_standard"]
    diffs = [fused["tokens_by_problem"][k] - std["tokens_by_problem"][k] for k in std["tokens_by_problem"]]
    assert pair["problems"] == 3 and pair["shorter"] == sum(d < 0 for d in diffs)
    assert pair["mean_diff"] == pytest.approx(sum(diffs) / 3, abs=0.01)
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "Mean generated tokens" in md and "Per-problem pairing with standard decoding" in md


def test_every_generation_counts_and_pairs_by_request_index():
    """Repeats and identical prompts are separate problems (keyed by request index, not by text): the
    length statistics count every generation."""
    from types import SimpleNamespace

    from lm_eval.api.model import CacheHook

    from fbt_megatron.eval.lm_eval_model import FBTLM

    class Text:
        def generate(self, prompts, params, **_):
            return [SimpleNamespace(text=p, tokens=[0] * n) for p, n in zip(prompts, lengths.pop(0))]

    lm = FBTLM.__new__(FBTLM)
    lm.text, lm.batch_size, lm.max_length, lm.seed, lm.padding, lm.chat_tokenizer = Text(), 8, 64, 0, "left", None
    lm.generated_lengths, lm.generated_by_problem, lm.prompt_by_problem = [], {}, {}
    lm.cache_hook = CacheHook(None)
    lengths = [[3, 5, 10]]
    reqs = [SimpleNamespace(args=(p, {"until": ["\n"], "max_gen_toks": 10})) for p in ["same", "same", "other"]]
    assert lm.generate_until(reqs, disable_tqdm=True) == ["same", "same", "other"]
    assert sorted(lm.generated_by_problem.values()) == [3, 5, 10]
    assert lm.prompt_by_problem == {0: "same", 1: "same", 2: "other"}
    from fbt_megatron.eval.lengths import length_stats

    assert length_stats(lm.generated_by_problem) == {"median_tokens": 5, "mean_tokens": 6.0, "generations": 3}


def test_length_pairing_is_per_problem():
    from fbt_megatron.eval.lengths import length_stats, paired

    standard, fused = {"a": 10, "b": 5, "d": 7}, {"a": 6, "b": 5, "c": 1, "d": 9}
    assert paired(standard, fused) == {"problems": 3, "mean_diff": -0.67, "median_diff": 0, "shorter": 1, "equal": 1,
                                       "longer": 1}
    assert length_stats(fused) == {"median_tokens": 5.5, "mean_tokens": 5.25, "generations": 4}
    assert paired(standard, {"x": 1}) is None


def test_sft_recipes_are_checked_before_anything_runs(fx, tmp_path):
    from tests.support.training import resolved_recipe as resolve
    from fbt_megatron.recipe import RecipeError, load_recipe
    from tests.support.chat_helpers import sft_recipe as make

    plain = make(tmp_path, fx)
    plain["data"]["pipeline"] = chat_data_section(fx, name="text")
    with pytest.raises(RecipeError, match=r"source 'text' .* is not a chat dataset"):
        resolve(load_recipe(data=plain), "sft")
    causal = make(tmp_path, fx, model={"attention_mask": "causal"})
    with pytest.raises(RecipeError, match=r"model.attention_mask.*document_causal"):
        resolve(load_recipe(data=causal), "sft")
    missing = make(tmp_path, fx, init_from=tmp_path / "nowhere")
    del missing["model"]
    with pytest.raises(RecipeError, match=r"init_from.*nowhere does not exist"):
        resolve(load_recipe(data=missing), "sft")
    # `fbt train` of the same recipe without task: sft trains on it as a pretraining run would
    assert resolve(load_recipe(data=dict(plain, task="pretrain")), None).task == "pretrain"


def test_an_sft_recipe_without_a_schedule_gets_the_papers_mix_from_step_0(fx, base, tmp_path):
    """The SFT phase's pass mix defaults to the paper's 75/22/3 from step 0, also when the model comes
    from init_from (whose run switched at step 2 with another mix: its schedule is not inherited)."""
    from fbt_megatron.recipe import load_recipe
    from tests.support.training import resolved_recipe as resolve

    for keep_model in (True, False):
        r = sft_recipe(tmp_path, fx, base)
        del r["schedule"]
        if not keep_model:
            del r["model"]
        s = resolve(load_recipe(data=r), "sft").schedule
        assert (s.feedback_start_step, s.mix) == (0, [0.75, 0.22, 0.03]), keep_model


def test_an_sft_recipe_without_a_feedback_section_takes_the_checkpoints(fx, tmp_path):
    """The fusion is part of the architecture: an SFT recipe that sets no ``model``/``feedback`` section
    fine-tunes the model ``init_from`` was trained as (here an additive fusion with the ``state`` first
    input and another mixin), not the recipe defaults, whose weights would load under the same names."""
    from fbt_megatron.config import FeedbackConfig
    from fbt_megatron.recipe import load_recipe
    from tests.support.training import resolved_recipe as resolve

    trained_as = {"fusion": "additive", "first_input": "state", "prefix_mixin": 0.3, "jitter_std": 0.0}
    base = tmp_path / "base"
    run_distributed(train_fn, 1, tiny_recipe(
        base, data={"source": "pipeline", "pipeline": chat_data_section(fx, name="text")}, feedback=trained_as,
        model={"vocab_size": 512, "max_sequence_length": 64}, train={"steps": 1}, checkpoint={"at_end": True}))
    r = sft_recipe(tmp_path / "sft", fx, base)
    del r["model"], r["feedback"]
    got = resolve(load_recipe(data=r), "sft")
    assert got.feedback == FeedbackConfig(**trained_as)
    assert (got.model.vocab_size, got.model.max_sequence_length) == (512, 64)
    # a recipe that sets its own feedback section keeps it
    r = sft_recipe(tmp_path / "sft", fx, base, feedback={"prefix_mixin": 0.2})
    assert resolve(load_recipe(data=r), "sft").feedback == FeedbackConfig(jitter_std=0.02, prefix_mixin=0.2)


def test_fbt_sft_is_task_sft(fx, tmp_path):
    """`fbt sft RECIPE` runs a recipe that does not say `task: sft` as an SFT run: its plain-text source is
    refused by name before anything runs (`fbt train` of the same recipe would pretrain on it)."""
    import yaml

    r = sft_recipe(tmp_path / "run", fx, train={"steps": 1})
    del r["task"]
    r["data"]["pipeline"] = chat_data_section(fx, name="text")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
    out = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "-q", "sft", str(tmp_path / "r.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "source 'text'" in out.stderr and "is not a chat dataset" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
