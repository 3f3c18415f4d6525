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
    contracting["mix_1_2"]["jacobian"][0]["spectral_norm"] = 3.0  # its mean is now over 1
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
