"""Every `bash` block of the README and the task pages (docs/guides/) runs on the CPU, in a new folder,
or, where it needs a GPU, a cluster or a model download, parses with the command's own parser
(tests/support/doc_commands.py). A renamed flag then breaks this test, not a user."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_commands import ROOT, Block, blocks, check_syntax, make_workdir, run_block

pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
# Pages that start from a trained run find one at runs/tiny (a short run of the main recipe).
NEEDS_TRAINED_RUN = {"evaluate.md", "export-and-serve.md", "instruction-tuning.md"}
BLOCK_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def embedded():
    from data_pipeline.embedded import build_embedded

    out = ROOT / "data" / "embedded"
    build_embedded(out)  # does nothing when already built with the same settings
    return out


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, embedded):
    work = tmp_path_factory.mktemp("trained")
    make_workdir(work, embedded)
    block = Block("fixture", 0, ".venv/bin/fbt train recipes/tiny.yaml train.steps=4 eval.every=2 "
                  "checkpoint.every=2 data.valid_sequences=4 run_dir=runs/tiny\n", None)
    result = run_block(block, work, BLOCK_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "runs" / "tiny"


def test_every_page_has_commands():
    assert len(PAGES) >= 8, [p.name for p in PAGES]
    for page in PAGES:
        assert blocks(page), f"{page.name} shows no bash block"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_commands(page, tmp_path, embedded, request):
    work = tmp_path / "work"
    work.mkdir()
    make_workdir(work, embedded)
    if page.name in NEEDS_TRAINED_RUN:
        (work / "runs").mkdir()
        (work / "runs" / "tiny").symlink_to(request.getfixturevalue("trained_run"))
    errors = []
    for block in blocks(page):
        if block.check_only:
            errors += check_syntax(block, work)
            continue
        result = run_block(block, work, BLOCK_TIMEOUT_S)
        if result.returncode:
            errors.append(f"{block.page}:{block.line} exited {result.returncode}:\n{block.body}\n"
                          f"{result.stdout[-1500:]}\n{result.stderr[-3000:]}")
    assert not errors, "\n\n".join(errors)


def test_a_wrong_flag_in_a_readme_block_fails(tmp_path, embedded):
    page = tmp_path / "README.md"
    page.write_text("<!-- doc-test: cluster -->\n```bash\n.venv/bin/fbt generate runs/tiny --prompt hi "
                    "--max-new-tokenz 4\n```\n\n```bash\n.venv/bin/fbt ckpt verfy runs/tiny\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    make_workdir(work, embedded)
    checked, run = blocks(page)
    assert check_syntax(checked, work) != []
    assert run_block(run, work, 120).returncode != 0
    fixed = Block(checked.page, checked.line, checked.body.replace("tokenz", "tokens"), checked.check_only)
    assert check_syntax(fixed, work) == []
