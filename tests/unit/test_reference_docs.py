"""The reference pages (docs/reference/) are what tools/gen_reference.py generates from the code now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
gen = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gen)


def test_every_recipe_key_has_a_description_on_its_field():
    _, missing = gen.recipe_reference()
    assert missing == []


def test_recipe_page_lists_every_key_of_the_schema():
    from data_pipeline.config import DataConfig
    from fbt_megatron.recipe import Recipe

    page = (ROOT / "docs/reference/recipe.md").read_text()
    assert "| `feedback.loss_on` |" in page and "| `parallel.zero_stage` |" in page
    for name in Recipe.model_fields:
        assert f"| `{name}" in page, name
    for name in DataConfig.model_fields:
        if name != "sources":
            assert f"| `data.pipeline.{name}` |" in page, name
    assert "| `data.pipeline.sources[].weight` |" in page


def test_each_key_is_listed_once_with_a_readable_type_and_its_real_default():
    """A list of sections is ``key[].field`` (once, not also ``key.field``); a constrained type reads as
    its type; a default filled from another key names that key, not the field's placeholder."""
    import re

    text, _ = gen.recipe_reference()
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]*) \|", text, re.M)
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys)) and "data.pipeline.sources.name" not in keys
    types_ = {k: t for k, t, _ in rows}
    defaults = {k: d for k, _, d in rows}
    assert types_["optimizer.betas"] == "tuple[float, float]" and not any("Annotated" in t for t in types_.values())
    assert defaults["schedule.seed"] == "the recipe's `seed`"
    assert defaults["data.pipeline.seq_length"] == "always `data.seq_length`"


def test_recipe_page_is_current():
    text, _ = gen.recipe_reference()
    assert (ROOT / "docs/reference/recipe.md").read_text() == text, "run python tools/gen_reference.py"


def test_a_planted_stale_entry_is_caught(tmp_path, monkeypatch):
    stale = tmp_path / "recipe.md"
    text = (ROOT / "docs/reference/recipe.md").read_text()
    planted = text.replace("| `feedback.jitter_std` | float | `0.02` |", "| `feedback.jitter_std` | float | `0.05` |")
    assert planted != text
    stale.write_text(planted)
    monkeypatch.setattr(gen, "RECIPE_PAGE", stale)
    monkeypatch.setattr(gen, "CLI_PYTHON", (0, 0))  # the command page is checked by the next test
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.stale_pages() == ["recipe.md"]
    assert gen.main(["--check"]) == 1


@pytest.mark.slow  # imports every command (about 15 s)
@pytest.mark.skipif(sys.version_info[:2] != gen.CLI_PYTHON, reason="argparse's help wording is per Python version")
def test_command_page_is_current_and_covers_every_command():
    from fbt_megatron.cli import COMMANDS

    page = (ROOT / "docs/reference/cli.md").read_text()
    for name in COMMANDS:
        assert f"## fbt {name}\n" in page, name
    assert page == gen.cli_reference(), "run python tools/gen_reference.py"
