"""A checkpoint whose files are missing, cut short or changed is refused in one sentence that says what to
do for what the checkpoint was to be used for: resume a run, initialise one (init_from), or be read
(generate, eval, tools)."""

from __future__ import annotations

import json
import zlib

import pytest

from fbt_megatron.checkpoint.discovery import CheckpointError
from fbt_megatron.checkpoint.guards import verify_checksums
from fbt_megatron.checkpoint.manager import check_files_present

SHARD = "weights/__0_0.distcp"


def _checkpoint(root, step: int):
    """A published step directory as a save leaves it: one weights file, listed in manifest.json."""
    path = root / f"step_{step:08d}"
    (path / "weights").mkdir(parents=True)
    data = bytes(range(256)) * 4
    (path / SHARD).write_bytes(data)
    (path / "state.json").write_text("{}")
    (path / "manifest.json").write_text(json.dumps(
        {"files": {SHARD: {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}}}))
    return path


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "checkpoints"
    return root, _checkpoint(root, 2), _checkpoint(root, 4)


ADVICE = {
    "resume": "resume from the previous checkpoint step_00000002 with `echo step_00000002 > {root}/latest` and "
              "the same fbt train command",
    "init_from": "set init_from to the previous checkpoint {root}/step_00000002",
    "read": "give the previous checkpoint {root}/step_00000002 instead",
}


@pytest.mark.parametrize("use", sorted(ADVICE))
def test_a_truncated_or_missing_file_names_the_previous_checkpoint_for_its_use(run, use):
    root, _, step4 = run
    shard = step4 / SHARD
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        check_files_present(step4, use=use)
    assert str(err.value) == (f"checkpoint file {shard} has 100 bytes, expected 1024 bytes (truncated or overwritten), "
                              f"so step_00000004 was not loaded: " + ADVICE[use].format(root=root))
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        check_files_present(step4, use=use)
    assert str(err.value) == (f"checkpoint file {shard} is missing (expected 1024 bytes), so step_00000004 was not "
                              f"loaded: " + ADVICE[use].format(root=root))


@pytest.mark.parametrize("use", sorted(ADVICE))
def test_a_changed_byte_names_the_previous_checkpoint_for_its_use(run, use):
    root, _, step4 = run
    shard = step4 / SHARD
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    check_files_present(step4, use=use)  # the size is right: only the checksum finds it
    with pytest.raises(CheckpointError, match="does not match the checksum") as err:
        verify_checksums(step4, use=use)
    assert str(err.value).endswith("so step_00000004 is corrupted and was not loaded: " + ADVICE[use].format(root=root))


def test_without_an_earlier_checkpoint_only_training_is_offered_the_switch(run):
    root, step2, _ = run
    shard = step2 / SHARD
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    for use in ("resume", "init_from"):
        with pytest.raises(CheckpointError) as err:
            verify_checksums(step2, use=use)
        assert str(err.value).endswith(f"not loaded: no earlier checkpoint is kept in {root}; set "
                                       f"checkpoint.verify_on_load=false only if you accept the damage")
    with pytest.raises(CheckpointError) as err:
        verify_checksums(step2, use="read")  # fbt generate, fbt eval: no recipe key to set
    assert str(err.value).endswith(f"not loaded: no earlier checkpoint is kept in {root}")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError) as err:
        check_files_present(step2)  # a cut file is refused whatever verify_on_load says: no switch offered
    assert str(err.value).endswith(f"not loaded: no earlier checkpoint is kept in {root}")
