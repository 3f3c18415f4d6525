"""The lm-eval adapter end to end: a local task definition and a local jsonl dataset run through
lm-eval's own simple_evaluate with --model fbt; the log-likelihoods it reports are those of the
exact recurrence (sequential_forward), computed independently here."""

import json
import os

import pytest
import torch

from tests.support.generate_helpers import make_tokenizer, save_run

DOCS = [
    {"question": "Question: what is 3 plus 4?\nAnswer:", "choices": [" 7", " 8", " 12"], "label": 0,
     "answer": "7", "text": "x = 1 + 2\nprint(x)"},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a * b"], "label": 0, "answer": "a + b",
     "text": "The answer is 42."},
    {"question": "x =", "choices": [" 1", " 2"], "label": 1, "answer": "2", "text": "for i in range(10):"},
]

TASKS = {
    "fbt_local_mc": """task: fbt_local_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
    "fbt_local_gen": """task: fbt_local_gen
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n", {stop}], max_gen_toks: 6, do_sample: false}}
metric_list:
  - metric: exact_match
""",
    "fbt_local_ppl": """task: fbt_local_ppl
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
}


def write_tasks(directory, stop: str = "\n"):
    """The local tasks; fbt_local_gen stops at a newline or at ``stop``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory.parent / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, text in TASKS.items():
        (directory / f"{name}.yaml").write_text(text.format(data=data, stop=json.dumps(stop)))
    return directory


def exact_logprob(model, context, continuation):
    from fbt_megatron.model.sequential import sequential_forward

    ids = torch.tensor([context + continuation])
    logp = torch.log_softmax(sequential_forward(model, ids).logits[0].double(), -1)
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


@pytest.mark.slow  # lm-eval end to end (~10 s)
def test_lm_eval_runs_local_tasks_through_fbt_model(tmp_path, single_process, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    import fbt_megatron.eval.lm_eval_model  # noqa: F401  registers "fbt"

    from fbt_megatron.generate.loading import load_for_inference

    tok = make_tokenizer(tmp_path)
    save_run(tmp_path / "run", tok)
    loaded = load_for_inference(tmp_path / "run")
    sp, model = loaded.tokenizer, loaded.model
    # A stop string the model does produce (a random model never writes "\n" within 6 tokens): a character
    # of the first document's unconstrained greedy text, after its first one. The adapter must cut there.
    free = greedy_exact(model, sp, DOCS[0]["question"], max_new_tokens=6, stops=[])
    stop = next(c for c in free[1:] if c != "\ufffd" and not c.isspace())
    tasks = write_tasks(tmp_path / "tasks", stop=stop)
    out = lm_eval.simple_evaluate(
        model="fbt", model_args=f"checkpoint={tmp_path / 'run'},mode=feedback,prefill_passes=exact,batch_size=2",
        tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
        bootstrap_iters=0)
    res = out["results"]
    assert {"acc,none", "exact_match,none", "word_perplexity,none"} <= set(res["fbt_local_mc"]) | \
        set(res["fbt_local_gen"]) | set(res["fbt_local_ppl"])

    # the adapter's numbers, checked against the exact recurrence computed here
    correct = 0
    for sample in out["samples"]["fbt_local_mc"]:
        got = [float(r[0][0]) for r in sample["resps"]]
        want = []
        for context, continuation in sample["arguments"]:  # as lm-eval built them (target delimiter)
            whole, ctx = sp.encode(context + continuation), sp.encode(context)
            want.append(exact_logprob(model, ctx, whole[len(ctx):]))
        assert got == pytest.approx(want, abs=1e-4)
        correct += int(max(range(len(want)), key=want.__getitem__) == sample["doc"]["label"])
    assert res["fbt_local_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))

    for sample in out["samples"]["fbt_local_ppl"]:
        ids = sp.encode(sample["doc"]["text"])
        want = exact_logprob(model, [sp.eos_id()], ids)
        assert float(sample["resps"][0][0]) == pytest.approx(want, abs=1e-4)

    # generate_until: greedy decoding of the exact recurrence, token by token, written out here (the
    # adapter decodes with the KV-cache decoder; this re-runs sequential_forward on the growing sequence).
    generated = {}
    for sample in out["samples"]["fbt_local_gen"]:
        want = greedy_exact(model, sp, sample["doc"]["question"], max_new_tokens=6, stops=["\n", stop])
        assert sample["resps"][0][0] == want
        generated[sample["doc"]["question"]] = want
    assert len(generated) == len(DOCS) and any(generated.values()), generated  # the check compared tokens
    assert generated[DOCS[0]["question"]] == free[: free.index(stop)] != free  # the stop cut the first one short


def greedy_exact(model, sp, prompt: str, max_new_tokens: int, stops: list[str]) -> str:
    """Greedy tokens of sequential_forward (argmax over the tokenizer's pieces), stopping at EOS, after
    max_new_tokens, or once the text holds one of ``stops`` (cut before the earliest)."""
    from fbt_megatron.model.sequential import sequential_forward

    ids = list(sp.encode(prompt)) or [sp.eos_id()]
    new = []
    for _ in range(max_new_tokens):
        logits = sequential_forward(model, torch.tensor([ids + new])).logits[0, -1, : sp.get_piece_size()]
        token = int(logits.argmax())
        if token == sp.eos_id():
            break
        new.append(token)
        if any(s in sp.decode(new) for s in stops):
            break
    text = sp.decode(new)
    cuts = [text.index(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def test_an_unknown_task_is_named_with_the_closest_names():
    from fbt_megatron.eval.cli import UnknownTask, check_task_names

    known = ["fbt_humaneval", "fbt_gsm8k", "hellaswag", "humaneval"]
    check_task_names(["hellaswag", "fbt_gsm8k"], known)
    with pytest.raises(UnknownTask, match=r"^--tasks: 'fbt_humaneva' is not a task lm-eval knows; did you mean "
                                          r"'fbt_humaneval' or 'humaneval'\?$"):
        check_task_names(["hellaswag", "fbt_humaneva"], known)
    with pytest.raises(UnknownTask, match=r"'zzz' is not a task lm-eval knows; give an lm-eval task name or a task "
                                          r"YAML file \(`lm-eval ls tasks` lists them\)$"):
        check_task_names(["zzz"], known)


def test_fbt_eval_keeps_a_users_files_in_its_out_folder(tmp_path, single_process, monkeypatch, capsys):
    """fbt eval replaces eval.md and eval.json in its output folder: a user's file of either name is refused
    in one sentence before anything is evaluated, and kept; an earlier fbt eval's pair is replaced."""
    from data_pipeline.output_dir import OutputDirError
    from fbt_megatron.cli import main
    from fbt_megatron.eval import cli as eval_cli

    save_run(tmp_path / "run", make_tokenizer(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.md").write_text("# my notes on the run\n")
    (out / "other.txt").write_text("mine\n")
    monkeypatch.setattr(eval_cli, "evaluate", lambda *a, **k: pytest.fail("evaluated before --out was checked"))
    assert main(["eval", str(tmp_path / "run"), "--tasks", "fbt_humaneval", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"fbt eval: error: --out {out} holds eval.md, which fbt eval did not write: "
                                       "nothing was changed; choose another --out, or move it away\n")
    assert (out / "eval.md").read_text() == "# my notes on the run\n" and (out / "other.txt").is_file()
    assert main(["eval", str(tmp_path / "run"), "--tasks", "fbt_humaneval", "--out", str(out / "other.txt")]) == 2
    assert capsys.readouterr().err == (f"fbt eval: error: --out {out / 'other.txt'} is a file, not a directory: "
                                       "nothing was changed; choose another --out\n")
    def no_lm_eval(*a, **k):
        raise ModuleNotFoundError("No module named 'lm_eval'")

    with monkeypatch.context() as m:  # without the eval extra: what to install, in one sentence
        m.setattr(eval_cli, "task_manager", no_lm_eval)
        assert main(["eval", str(tmp_path / "run"), "--tasks", "fbt_humaneval", "--out", str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err == ("fbt eval: error: fbt eval needs lm-eval: pip install 'fbt_megatron[eval]' "
                                       "(No module named 'lm_eval')\n")
    (out / "eval.json").write_text('{"results": {}}')
    with pytest.raises(OutputDirError, match="holds eval.json and eval.md, which fbt eval did not write"):
        eval_cli.check_out(out, "--out")
    # an earlier fbt eval's files: its title line, and its JSON's checkpoint, modes, prefill and tasks
    (out / "eval.md").write_text("# fbt eval: runs/tiny/checkpoints/step_00000600\n\n| task | metric |\n")
    (out / "eval.json").write_text(json.dumps({"checkpoint": "c", "modes": ["standard"], "prefill": {}, "tasks": {}}))
    eval_cli.check_out(out, "--out")


@pytest.mark.slow  # fbt eval end to end (~10 s)
def test_fbt_eval_writes_mode_table(tmp_path, single_process, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    from fbt_megatron.cli import main

    tok = make_tokenizer(tmp_path)
    save_run(tmp_path / "run", tok)
    tasks = write_tasks(tmp_path / "tasks")
    common = [str(tmp_path / "run"), "--modes", "standard,fused", "--limit", "2", "--out", str(tmp_path / "out")]
    # code tasks refuse to run without the explicit opt-in, named as this command's option
    assert main(["eval", *common, "--tasks", "fbt_humaneval"]) == 2
    assert capsys.readouterr().err.endswith(
        "fbt eval: error: --tasks fbt_humaneval runs the programs the model writes: add --allow-code-execution to "
        "run them (each in a sandboxed subprocess)\n")
    import fbt_megatron.generate.loading as loading

    with monkeypatch.context() as m:  # a typo: the closest names, before the model is loaded
        m.setattr(loading, "load_for_inference", lambda *a, **k: pytest.fail("loaded before the task names"))
        assert main(["eval", *common, "--tasks", "fbt_humaneva"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fbt eval: error: --tasks: 'fbt_humaneva' is not a task lm-eval knows; did you mean "
                          "'fbt_humaneval' or ") and err.count("\n") == 1, err
    rc = main(["eval", *common, "--tasks", f"{tasks / 'fbt_local_gen.yaml'},fbt_humaneval", "--allow-code-execution"])
    assert rc == 0
    table = json.loads((tmp_path / "out" / "eval.json").read_text())["tasks"]
    assert set(table) == {"fbt_local_gen", "fbt_humaneval"}
    for task in table:
        assert set(table[task]) == {"standard", "fused"}
        for row in table[task].values():
            assert row["value"] is not None and 0.0 <= row["value"] <= 1.0
            assert row["generations"] == 2 and row["median_tokens"] >= 1
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "| task | metric | standard | FUSED |" in md and "Median generated tokens" in md
