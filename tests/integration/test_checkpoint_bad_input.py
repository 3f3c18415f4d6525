"""Checkpoint robustness: re-saving a published step, pruning, resume=false, and bad input (missing or
truncated shard file, wrong shapes for the recipe's model, `latest` naming a missing directory) giving
errors that name the file and the expected value, with the previous checkpoint still loadable.

All runs happen one after the other in one process (faults are raised through the save's fault hook),
since starting processes costs more than these tiny runs."""

import json
import shutil
from pathlib import Path

import zlib

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe


class Crash(Exception):
    pass


def _crash_at(fault: str):
    want_point, want_step = fault.split("@")

    def hook(point, step):
        if point == want_point and step == int(want_step):
            raise Crash(fault)

    return hook


def _train(recipe: dict, fault: str | None = None) -> dict | str:
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.run import train

    try:
        return train(load_recipe(data=recipe), print_fn=lambda *a, **k: None,
                     checkpoint_fault_hook=_crash_at(fault) if fault else None).summary()
    except Crash as e:
        return f"crash {e}"
    except Exception as e:  # the error a user would see
        return f"{type(e).__name__}: {e}"


def _load_weights(ckpt: Path, recipe: dict) -> str:
    from fbt_megatron.checkpoint import load_model_weights
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_recipe

    r = load_recipe(data=recipe)
    try:
        load_model_weights(ckpt, build_model(r.model, r.feedback))
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _tensors(ckpt: Path) -> dict:
    from fbt_megatron.checkpoint.manager import read_full_tensors

    return read_full_tensors(ckpt)


def scenario(base: str) -> dict:
    base = Path(base)
    out = {}
    recipe = tiny_recipe(base / "run", train={"steps": 4}, checkpoint={"every": 2, "keep_last": 2})
    ckpts = base / "run" / "checkpoints"
    # A: step 4 is published but the process dies before `latest` moves to it.
    out["A"] = _train(recipe, "before_latest@4")
    straight = _tensors(ckpts / "step_00000004")  # the straight run's step 4 (B and C replace it)
    out["A_latest"] = (ckpts / "latest").read_text().strip()
    out["A_dirs"] = sorted(p.name for p in ckpts.iterdir())
    # B: the resume from step 2 re-saves step 4 and dies before publishing it: the published step_4 stays.
    out["B"] = _train(recipe, "before_rename@4")
    out["B_dirs"] = sorted(p.name for p in ckpts.iterdir())
    out["B_state"] = json.loads((ckpts / "step_00000004" / "state.json").read_text())["train_state"]["step"]
    # B2: the next resume re-saves step 4 and dies between its renames: the published step_4 is aside (.old).
    out["B2"] = _train(recipe, "between_renames@4")
    out["B2_dirs"] = sorted(p.name for p in ckpts.iterdir())
    # C: a clean resume finishes (its save first puts step_4.old back); keep_last=2 keeps steps 2 and 4.
    out["C"] = _train(recipe)["step"]
    out["C_dirs"] = sorted(p.name for p in ckpts.iterdir())
    resumed = _tensors(ckpts / "step_00000004")
    out["C_same_as_straight"] = sorted(straight) == sorted(resumed) and all(
        torch.equal(straight[k], resumed[k]) for k in straight)
    out["C_tensors"] = len(straight)
    step4 = ckpts / "step_00000004"
    out["C_manifest"] = json.loads((step4 / "manifest.json").read_text())["files"]
    out["C_files"] = {str(f.relative_to(step4)): {"bytes": f.stat().st_size, "crc32": f"{zlib.crc32(f.read_bytes()):08x}"}
                      for f in step4.rglob("*") if f.is_file()}
    # D: resume=false refuses a directory that already holds checkpoints.
    out["D"] = _train(dict(recipe, checkpoint=dict(recipe["checkpoint"], resume=False)))
    # E: bad input, each on a copy of the run.
    def copy(name):
        dst = base / name
        shutil.copytree(base / "run", dst)
        return dict(recipe, run_dir=str(dst)), dst / "checkpoints"

    r, c = copy("truncated")
    shard = sorted((c / "step_00000004" / "weights").glob("*.distcp"))[0]
    out["E_truncated_file"], out["E_truncated_bytes"] = str(shard), shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    out["E_truncated"] = _train(dict(r, train=dict(r["train"], steps=6)))
    out["E_previous_loads"] = _load_weights(c / "step_00000002", recipe)
    r, c = copy("missing")
    shard = sorted((c / "step_00000004" / "weights").glob("*.distcp"))[0]
    out["E_missing_file"] = str(shard)
    shard.unlink()
    out["E_missing"] = _train(dict(r, train=dict(r["train"], steps=6)))
    r, c = copy("shape")
    wider = dict(r, train=dict(r["train"], steps=6), model=dict(r["model"], hidden_size=96))
    out["E_shape_plan"] = _train(wider)  # the plan reads the checkpoint's recipe
    state = c / "step_00000004" / "state.json"  # a recipe record that disagrees with the tensors: the load checks
    record = json.loads(state.read_text())
    record["recipe"]["model"]["hidden_size"] = 96
    state.write_text(json.dumps(record))
    out["E_shape"] = _train(wider)
    r, c = copy("pointer")
    (c / "latest").write_text("step_00000099\n")
    out["E_pointer"] = _train(dict(r, train=dict(r["train"], steps=6)))
    out["E_pointer_dir"] = str(c / "step_00000099")
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_distributed(scenario, 1, str(tmp_path_factory.mktemp("ckpt")))[0]


def test_resave_keeps_published_step_until_replaced(result):
    assert result["A"] == "crash before_latest@4"
    assert result["A_latest"] == "step_00000002" and "step_00000004" in result["A_dirs"]
    assert result["B"] == "crash before_rename@4"
    assert "step_00000004" in result["B_dirs"] and result["B_state"] == 4  # not deleted before replacement
    assert result["B2"] == "crash between_renames@4"
    assert "step_00000004.old" in result["B2_dirs"] and "step_00000004" not in result["B2_dirs"]
    assert result["C"] == 4
    assert result["C_dirs"] == ["latest", "step_00000002", "step_00000004"]


def test_a_resumed_run_saves_what_the_straight_run_saved(result):
    """Resuming from step 2 (weights, AdamW moments, RNG, data cursor read back) and training to step 4
    gives the straight run's step 4 bit for bit: every master weight and moment."""
    assert result["C_tensors"] > 0 and result["C_same_as_straight"]


def test_the_manifest_lists_every_file_with_its_size_and_crc(result):
    """manifest.json: every file of the checkpoint (weights shards, .metadata, common.pt, each rank's RNG,
    the tokenizer of a run on tokenized data) with its size and CRC-32: all but itself and state.json."""
    files = dict(result["C_files"])
    assert {"manifest.json", "state.json", "weights/.metadata", "weights/common.pt"} <= set(files)
    del files["manifest.json"], files["state.json"]
    assert result["C_manifest"] == files


def test_resume_false_refuses_used_directory(result):
    assert result["D"].startswith("PlanError") and "recipe key 'checkpoint.resume': checkpoint.resume=false" in result["D"]
    assert "/run/checkpoints" in result["D"]


def test_truncated_shard_names_file_and_size_previous_loads(result):
    msg = result["E_truncated"]
    assert result["E_truncated_file"] in msg and f"expected {result['E_truncated_bytes']} bytes" in msg, msg
    assert "so step_00000004 was not loaded: resume from the previous checkpoint step_00000002 with `echo " \
           "step_00000002 > " in msg and msg.endswith("/checkpoints/latest` and the same fbt train command"), msg
    assert result["E_previous_loads"] == "ok"


def test_missing_shard_names_file(result):
    assert result["E_missing_file"] in result["E_missing"] and "missing" in result["E_missing"]


def test_wrong_shape_names_tensor_and_expected_shape(result):
    """A resume with another width is refused by the plan, naming the key and both values; where the
    checkpoint's recipe record agrees with the recipe but its tensors do not, the load names the tensor, both
    shapes and what to do."""
    msg = result["E_shape_plan"]
    assert msg.startswith("PlanError: recipe key 'model.hidden_size'") and "model.hidden_size=64" in msg, msg
    msg = result["E_shape"]
    assert "CheckpointError" in msg and ".metadata" in msg and "[128, 96]" in msg, msg
    assert msg.endswith("a run resumes only with the model it was trained with: set the recipe's model and feedback "
                        "sections back to the run's (fbt ckpt inspect shows them), or use a new run_dir"), msg


def test_latest_naming_missing_dir(result):
    msg = result["E_pointer"]
    assert "step_00000099" in msg and result["E_pointer_dir"] in msg, msg
