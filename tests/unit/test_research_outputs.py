"""The research tools write only what they wrote before: a results page, its JSON report and its figure
(``STEM.md``, ``STEM.json``, ``STEM.png`` in ``--out``) replace earlier ones, and a user's file under one of
those names is refused before any run starts (and again when the page is saved); the chat JSONL that
``tools/sft_math.py conversations`` writes replaces only an earlier one."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from data_pipeline.output_dir import OutputDirError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def tool(name: str):
    spec = importlib.util.spec_from_file_location(f"research_output_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Ran(Exception):
    """Raised by the first step of a tool's runs: the check did not come before them."""


def ran(*args, **kwargs):
    raise Ran


# tool -> (its page stem, argv before --out, what its runs call first: "NAME" in the tool, or "module:NAME")
TOOLS = {
    "data_efficiency": ("data_efficiency", [], "run"),
    "fixed_point": ("fixed_point", [], "train_models"),
    "fused_prefill": ("fused_prefill", ["runs/does-not-matter"], "fbt_megatron.runtime:init_distributed"),
    "probe_layer0": ("probes", [], "fbt_megatron.runtime:init_distributed"),
    "switch_init": ("switch_init", [], "fbt_megatron.research.runs:run_jobs"),
    "sft_math": ("sft", ["run"], "data_pipeline.embedded:build_embedded"),
    "feedback_study": ("feedback_study_tiny_orders_smoke", ["--smoke"], "train"),
}

USER_FILES = {"md": "# my notes\n\nkeep these\n", "json": json.dumps({"mine": True}), "png": b"\x89PNG my own figure"}


@pytest.mark.parametrize("suffix", sorted(USER_FILES))
@pytest.mark.parametrize("name", sorted(TOOLS))
def test_a_tool_refuses_a_users_file_in_out_before_its_runs(name, suffix, tmp_path, monkeypatch):
    stem, argv, first_step = TOOLS[name]
    module = tool(name)
    where, _, attr = first_step.rpartition(":")
    monkeypatch.setattr(importlib.import_module(where) if where else module, attr, ran)
    monkeypatch.chdir(tmp_path)  # sft_math changes directory: restored after the test
    user_file = tmp_path / "out" / f"{stem}.{suffix}"
    user_file.parent.mkdir()
    content = USER_FILES[suffix]
    (user_file.write_bytes if isinstance(content, bytes) else user_file.write_text)(content)
    with pytest.raises(OutputDirError) as e:
        module.main([*argv, "--out", str(tmp_path / "out")])
    assert str(e.value) == (f"--out {tmp_path / 'out'} holds {stem}.{suffix}, which a research tool did not write: "
                            "nothing was changed; choose another --out, or move it away")
    assert (user_file.read_bytes() if isinstance(content, bytes) else user_file.read_text()) == content



@pytest.mark.parametrize("stem", ["fixed_point", "probes", "sft", "fused_prefill", "data_efficiency",
                                  "feedback_study_tiny_1200_lr0.001_orders"])
def test_a_tools_own_page_report_and_figure_are_replaced(stem, tmp_path):
    from fbt_megatron.research.report import save

    for suffix in ("md", "json", "png"):
        shutil.copy(RESULTS / f"{stem}.{suffix}", tmp_path / f"{stem}.{suffix}")
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    save(tmp_path, stem, "# the page again\n\n_Produced by `python tools/x.py` today._", data)
    assert (tmp_path / f"{stem}.md").read_text().startswith("# the page again")


def test_a_users_own_matplotlib_figure_is_not_taken_for_a_tools(tmp_path):
    """A matplotlib PNG is a tool's only beside the page or the report a tool wrote (a tool writes both
    first): a user's own figure under a tool's name, alone or beside the user's own page, is refused and kept."""
    from fbt_megatron.research.report import check_report_files

    figure = (RESULTS / "probes.png").read_bytes()  # a matplotlib PNG, as a user's own would be
    (tmp_path / "probes.png").write_bytes(figure)
    with pytest.raises(OutputDirError, match=r"holds probes.png, which a research tool did not write"):
        check_report_files(tmp_path, "probes")
    (tmp_path / "probes.md").write_text("# my page\n")
    with pytest.raises(OutputDirError, match=r"holds probes.md and probes.png, which a research tool did not"):
        check_report_files(tmp_path, "probes")
    shutil.copy(RESULTS / "probes.md", tmp_path / "probes.md")  # beside a tool's page: the tool's figure
    check_report_files(tmp_path, "probes")
    (tmp_path / "probes.md").unlink()
    shutil.copy(RESULTS / "probes.json", tmp_path / "probes.json")  # beside a tool's report: the tool's figure
    check_report_files(tmp_path, "probes")
    assert (tmp_path / "probes.png").read_bytes() == figure


def test_save_refuses_a_users_page_and_writes_nothing(tmp_path):
    from fbt_megatron.research.report import save

    (tmp_path / "probes.md").write_text("# my page\n")
    with pytest.raises(OutputDirError, match="holds probes.md, which a research tool did not write"):
        save(tmp_path, "probes", "# new", {"provenance": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probes.md"]
    assert (tmp_path / "probes.md").read_text() == "# my page\n"


def test_the_conversations_replace_only_an_earlier_conversations_file(tmp_path):
    from fbt_megatron.errors import UserError
    from fbt_megatron.research.sft import write_conversations

    out = tmp_path / "math_chat.jsonl"
    first = write_conversations(out, n_docs=3)
    assert len(out.read_text().splitlines()) == first
    more = write_conversations(out, n_docs=6)  # its own earlier output, made with fewer documents
    assert more > first and len(out.read_text().splitlines()) == more
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "my own data"}]}\n')
    with pytest.raises(UserError, match=r"mine.jsonl exists and is not a conversations file this tool wrote: "
                                        r"nothing was changed; choose another --out, or move it away"):
        write_conversations(mine, n_docs=3)
    assert mine.read_text() == '{"messages": [{"role": "user", "content": "my own data"}]}\n'
    with pytest.raises(UserError, match="is a directory: give a file name"):
        write_conversations(tmp_path, n_docs=3)
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    assert write_conversations(empty, n_docs=3) == first


def test_sft_math_checks_the_out_it_will_write_from_any_directory(tmp_path, monkeypatch):
    """sft_math's runs move into the repository, so a relative --out names a place there: the early check
    looks at that place, not at the caller's directory."""
    module = tool("sft_math")
    monkeypatch.setattr(module, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(importlib.import_module("data_pipeline.embedded"), "build_embedded", ran)
    (tmp_path / "repo" / "out").mkdir(parents=True)
    (tmp_path / "repo" / "out" / "sft.md").write_text("# my notes\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(OutputDirError, match="holds sft.md, which a research tool did not write"):
        module.main(["run", "--out", "out"])
