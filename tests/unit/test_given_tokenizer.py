"""``--tokenizer`` given to ``fbt convert to-hf`` or ``fbt generate`` for a checkpoint that carries the run's
tokenizer: another tokenizer is refused in one sentence (before, it exported and decoded text the model never
saw, exit 0); the same one, as a file or its folder, passes; with no copy to compare there is nothing to say."""

import pytest

from fbt_megatron.checkpoint.discovery import check_given_tokenizer
from fbt_megatron.errors import UserError


def test_another_tokenizer_than_the_checkpoints_copy_is_refused(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "tokenizer.model").write_bytes(b"the run's sentencepiece model")
    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "tokenizer.model").write_bytes(b"the run's sentencepiece model")
    (tmp_path / "other.model").write_bytes(b"another sentencepiece model")
    check_given_tokenizer(step, tmp_path / "same" / "tokenizer.model")
    check_given_tokenizer(step, tmp_path / "same")
    with pytest.raises(UserError) as e:
        check_given_tokenizer(step, tmp_path / "other.model")
    assert str(e.value).startswith(f"--tokenizer {tmp_path / 'other.model'} is not the tokenizer {step} was trained "
                                   "with (tokenizer.model ")
    assert str(e.value).endswith("leave --tokenizer out to use the checkpoint's copy")
    check_given_tokenizer(step, tmp_path / "missing.model")  # the loader names a missing file
    check_given_tokenizer(tmp_path / "run", tmp_path / "other.model")  # no copy to compare with


@pytest.mark.parametrize("command", ["to-hf", "generate"])
def test_both_commands_check_a_given_tokenizer(command, tmp_path, monkeypatch):
    """The check runs before anything is exported or generated (stopped at it here)."""
    from fbt_megatron.checkpoint import discovery

    calls = []

    def stop(checkpoint, given):
        calls.append((checkpoint, given))
        raise UserError("stopped at the check")

    monkeypatch.setattr(discovery, "check_given_tokenizer", stop)
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    (step / "state.json").write_text('{"recipe": {"model": {}}, "train_state": {"step": 4}}')
    with pytest.raises(UserError, match="stopped at the check"):
        if command == "to-hf":
            from fbt_megatron.hf.export import export_checkpoint

            export_checkpoint(tmp_path / "run", tmp_path / "out", tokenizer=str(tmp_path / "t.model"))
        else:
            from fbt_megatron.generate.loading import load_for_inference

            load_for_inference(tmp_path / "run", tokenizer=str(tmp_path / "t.model"))
    assert calls == [(step, str(tmp_path / "t.model"))]
