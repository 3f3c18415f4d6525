"""The results pages are made by their tools: each page under docs/results/ is what its tool writes from the
JSON it recorded, its opening answers included (a hand edit, or an answer that no longer follows from the
numbers, fails here)."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

# page stem -> the tool that writes it
PAGES = {
    "fixed_point": "fixed_point",
    "fused_prefill": "fused_prefill",
    "probes": "probe_layer0",
    "switch_init": "switch_init",
    "data_efficiency": "data_efficiency",
    "sft": "sft_math",
}


def tool(name: str):
    spec = importlib.util.spec_from_file_location(f"results_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recorded(stem: str) -> dict:
    return json.loads((RESULTS / f"{stem}.json").read_text())


@pytest.mark.parametrize("stem", sorted(PAGES))
def test_a_results_page_is_what_its_tool_writes_from_its_json(stem, tmp_path):
    tool(PAGES[stem]).render(recorded(stem), tmp_path, figure_too=False)
    assert (tmp_path / f"{stem}.md").read_text() == (RESULTS / f"{stem}.md").read_text(), \
        f"docs/results/{stem}.md differs from `python tools/{PAGES[stem]}.py --render-only`"
    assert (tmp_path / f"{stem}.json").read_text() == (RESULTS / f"{stem}.json").read_text()


@pytest.mark.parametrize("stem", sorted(PAGES))
def test_a_results_page_opens_with_its_answers(stem):
    lines = (RESULTS / f"{stem}.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert lines[2].startswith("| question | answer |"), f"{stem}.md does not open with its answers"


def test_the_fixed_point_answers_follow_the_one_step_norm():
    fixed_point = tool("fixed_point")
    data = recorded("fixed_point")
    assert [r[1] for r in fixed_point.answers(data["results"])] == ["Yes, both mixes", "No, not yet"]
    contracting = copy.deepcopy(data["results"])
    for r in contracting.values():
        for j in r["jacobian"]:
            j["spectral_norm"] = 0.5
    assert fixed_point.answers(contracting)[1][1] == "Yes, both mixes"
    contracting["mix_1_2"]["jacobian"][0]["spectral_norm"] = 1.2  # its mean stays under 1, one position is not
    assert fixed_point.answers(contracting)[1][1] == "Only 75/22/3"
    slow = copy.deepcopy(data["results"])
    slow["mix_1_2_3"]["residuals"][9] = 0.5
    assert fixed_point.answers(slow)[0][1] == "Only 1/2 mix"


def test_render_only_without_a_recorded_json_is_one_sentence(tmp_path, capsys):
    from fbt_megatron.research.report import run_tool

    assert run_tool(tool("fixed_point").main, "fixed_point", ["--render-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fixed_point: error: {tmp_path / 'fixed_point.json'} does not exist: run the tool once without "
                   "--render-only to record it."]
    (tmp_path / "fixed_point.json").write_text("{not json")
    assert run_tool(tool("fixed_point").main, "fixed_point", ["--render-only", "--out", str(tmp_path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_the_switch_init_answers_follow_the_last_step_losses():
    switch_init = tool("switch_init")
    data = recorded("switch_init")
    rows = switch_init.answers(data)
    assert [r[1] for r in rows] == ["Identity W_U with a unit-spread W_G", "No"]
    assert "5.157 against 6.004" in rows[0][2]
    baseline, identity = data["val_history"]  # normal / normal first, then identity / unit-spread
    flipped = copy.deepcopy(data)
    next(v for v in flipped["val_history"][baseline] if v["step"] == 600)["loss"]["3"] = 5.0  # now the lowest
    rows = switch_init.answers(flipped)
    assert rows[0][1] == "Normal W_U (depth-scaled) with a normal W_G (the baseline)"
    assert "5.000 against 5.157" in rows[0][2]
    moved = copy.deepcopy(data)
    next(v for v in moved["val_history"][identity] if v["step"] == 600)["loss"]["1"] = 4.9  # 0.118 over the baseline
    assert switch_init.answers(moved)[1][1:] == ["Yes, its 1-pass loss is higher",
                                                 "1-pass loss 4.900 against 4.782 (difference over 0.02)", "more seeds"]
    close = copy.deepcopy(data)  # a lead of 0.01 names no winner
    next(v for v in close["val_history"][baseline] if v["step"] == 600)["loss"]["3"] = 5.167
    assert switch_init.answers(close)[0][1].startswith("No clear winner")
    alone = {**data, "val_history": {identity: data["val_history"][identity],  # --variants without the baseline
                                     "identity W_U, normal W_G": data["val_history"][baseline]}}
    assert switch_init.answers(alone)[0][1] == "Identity W_U with a unit-spread W_G"


def test_the_probe_answers_follow_the_layer0_accuracies():
    probe_layer0 = tool("probe_layer0")
    data = recorded("probes")
    rows = probe_layer0.answers(data["results"], data["seeds"])
    assert [r[1] for r in rows] == ["Yes", "Yes", "Same direction"]
    assert "0.715 (majority) → 0.906 ± 0.013" in rows[0][2]
    forgot = copy.deepcopy(data["results"])
    by_key = forgot["delayed_memory"]["probes"]["recall_prev"]
    by_key["fbt/layer0_feedback1"] = list(by_key["majority_baseline"])  # one step no longer carries the answer
    rows = probe_layer0.answers(forgot, data["seeds"])
    assert [r[1] for r in rows] == ["Only completion tracking", "Yes", "Not reproduced here"]
    leaky = copy.deepcopy(data["results"])
    leaky["completion"]["probes"]["complete"]["fbt/layer0_feedback1_zeroed"] = [0.9, 0.9, 0.9]  # 0.185 over majority
    assert probe_layer0.answers(leaky, data["seeds"])[1][1:3] == [
        "No", "zeroed or shuffled states still carry completion tracking (zeroed / shuffled: completion tracking "
        "0.900 / 0.715; the previous answer 0.065 / 0.062)"]
    exact = copy.deepcopy(data["results"])
    exact["completion"]["probes"]["complete"]["fbt/layer0_feedback1"] = [1.0, 1.0, 1.0]  # both at or over 99.6 %
    assert probe_layer0.answers(exact, data["seeds"])[2][1] == "Same direction and size"


def test_the_data_efficiency_answers_follow_the_token_ratios_and_the_early_gap():
    data_efficiency = tool("data_efficiency")
    data = recorded("data_efficiency")
    rows = data_efficiency.answers(data["summary"])
    assert [r[1] for r in rows] == ["No, at this size", "Yes"]
    assert "needs 0.50 ± 0.02 of FBT's tokens" in rows[0][2]
    efficient = copy.deepcopy(data["summary"])
    for r in efficient["rows"]:
        r["tokens_ratio"] = 1.5
    assert data_efficiency.answers(efficient)[0][1:] == [
        "Yes", "the standard model needs 1.50 ± 0.00 of FBT's tokens to reach FBT's final loss", "–"]
    efficient["rows"][0]["tokens_ratio"] = None  # never reached: FBT needs fewer tokens there too
    efficient["rows"][1]["tokens_ratio"] = 0.5
    assert data_efficiency.answers(efficient)[0][1:3] == [
        "In 2 of 3 seeds", "the standard model needs 1.00 ± 0.71 of FBT's tokens to reach FBT's final loss "
        "(1 of 3 seeds never reach it)"]
    apart = copy.deepcopy(data["summary"])
    apart["rows"][2]["max_gap_before_switch"] = 0.2
    assert data_efficiency.answers(apart)[1][1] == "No (1 of 3 seeds)"


def test_the_fused_prefill_answers_follow_the_paired_differences():
    fused_prefill = tool("fused_prefill")
    data = recorded("fused_prefill")
    assert [r[1] for r in fused_prefill.answers(data)] == ["No", "No difference within the error"]
    better = copy.deepcopy(data)
    for r in better["rows"][1:]:
        r["paired_diff_vs_standard"] = -0.5  # ± 2 x 0.07: below zero
    assert fused_prefill.answers(better)[0][1:4:2] == ["Yes", "–"]
    better["rows"][1]["paired_diff_vs_standard"] = 0.0  # K=1: within its error
    assert fused_prefill.answers(better)[0][1] == "Only FUSED, K=3, exact"
    helps = copy.deepcopy(data)
    one = helps["rows"][1]["per_problem_nll"]
    helps["rows"][2]["per_problem_nll"] = [x - 0.2 + 0.01 * (i % 3) for i, x in enumerate(one)]
    assert fused_prefill.answers(helps)[1][1:4:2] == ["Yes", "–"]
    helps["rows"][2]["per_problem_nll"] = [x + 0.2 for x in one]
    assert fused_prefill.answers(helps)[1][1] == "No, it is worse"
    mirrored = copy.deepcopy(data)  # the recorded FUSED - K=1 differences with their sign turned: still within
    one, fused = mirrored["rows"][1]["per_problem_nll"], mirrored["rows"][2]["per_problem_nll"]
    mirrored["rows"][2]["per_problem_nll"] = [2 * x - y for x, y in zip(one, fused)]
    assert fused_prefill.answers(mirrored)[1][1] == "No difference within the error"


def test_the_sft_answers_follow_the_seeds():
    sft_math = tool("sft_math")
    data = recorded("sft")
    assert [r[1] for r in sft_math.answers(data)] == ["No", "Yes", "A hint only"]
    changed = copy.deepcopy(data)
    row = {(r["model"], r["mode"]): r for r in changed["rows"]}
    row[("fbt_sft", "fused")]["paired_mean_diff"] = [-4.2, 1.0]  # t(2) 4.30 x 1.0 / sqrt(3) = 2.5: below zero
    assert sft_math.answers(changed)[2][1:4:2] == ["Yes", "–"]
    row[("fbt_sft", "fused")]["paired_mean_diff"] = [0.5, 3.0]
    assert sft_math.answers(changed)[2][1] == "No"
    row[("std_sft", "standard")]["exact_match"] = [0.3, 0.05]  # a third of the problems, none by a base model
    assert sft_math.answers(changed)[0][1:4:2] == ["Yes", "–"]
    row[("fbt_sft", "fused")]["median_tokens"] = [46.0, 2.0]  # longer than a base model's median
    assert sft_math.answers(changed)[1][1] == "Partly"


@pytest.mark.parametrize("stem", ["fixed_point", "probes", "sft"])
def test_render_only_without_matplotlib_writes_the_page_and_keeps_the_figure(stem, tmp_path, monkeypatch, capsys):
    """The page and its JSON are written before the figure: a missing matplotlib loses nothing."""
    from fbt_megatron.research import report

    def no_matplotlib(*args, **kwargs):
        raise report.FigureLibraryMissing("the figures need matplotlib")

    monkeypatch.setattr(report, "figure", no_matplotlib)
    (tmp_path / f"{stem}.json").write_text((RESULTS / f"{stem}.json").read_text())
    old_figure = (RESULTS / f"{stem}.png").read_bytes() + b"the old one"
    (tmp_path / f"{stem}.png").write_bytes(old_figure)
    argv = (["run"] if stem == "sft" else []) + ["--render-only", "--out", str(tmp_path)]
    assert report.run_tool(tool(PAGES[stem]).main, PAGES[stem], argv) == 0
    assert (tmp_path / f"{stem}.md").read_text() == (RESULTS / f"{stem}.md").read_text()
    assert (tmp_path / f"{stem}.png").read_bytes() == old_figure
    assert capsys.readouterr().err.strip() == f"{stem}: the page is written, its figure kept as it was: " \
        "the figures need matplotlib"
