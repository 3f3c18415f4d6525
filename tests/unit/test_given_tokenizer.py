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
                                   "with (its tokenizer.model differs byte for byte: ")
    assert str(e.value).endswith("leave --tokenizer out to use the run's own copy")
    (tmp_path / "hf").mkdir()  # a tokenizer of the other kind
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match=r"\(a tokenizer.json, the run's is a tokenizer.model\)"):
        check_given_tokenizer(step, tmp_path / "hf")
    check_given_tokenizer(step, tmp_path / "missing.model")  # the loader names a missing file
    bare = tmp_path / "bare" / "checkpoints" / "step_00000004"
    bare.mkdir(parents=True)
    check_given_tokenizer(bare, tmp_path / "other.model")  # no copy to compare with
    (tmp_path / "bare" / "hf_import").mkdir()  # fbt convert from-hf's copy of the source's tokenizer
    (tmp_path / "bare" / "hf_import" / "tokenizer.json").write_text("{}")
    check_given_tokenizer(bare, tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(UserError, match=r"\(a tokenizer.model, the run's is a tokenizer.json\)"):
        check_given_tokenizer(bare, tmp_path / "other.model")


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


def test_the_runs_tokenizer_is_found_by_one_rule(tmp_path, monkeypatch):
    """run_tokenizer, which export, generation, evaluation and the --tokenizer check share: the checkpoint's
    copy first (what this checkpoint trained with), then an import's hf_import/ copy, then (checkpoints from
    before the copy) the recipe's data.pipeline.tokenizer, a relative one also from the checkpoint's parents;
    synthetic data has none, whatever pipeline section its recipe keeps; a recipe path not found is one
    sentence naming --tokenizer."""
    import shutil

    from fbt_megatron.checkpoint.discovery import CheckpointError, run_tokenizer
    from fbt_megatron.generate.loading import find_tokenizer
    from tests.support.generate_helpers import make_tokenizer

    sp = make_tokenizer(tmp_path / "tok")
    step = tmp_path / "repo" / "runs" / "r" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    pipeline = {"data": {"source": "pipeline", "pipeline": {"tokenizer": "data/tok.model"}}}
    synthetic = {"data": {"source": "synthetic", "pipeline": {"tokenizer": "data/tok.model"}}}
    with pytest.raises(CheckpointError, match=r"^the run's tokenizer data/tok.model \(its recipe's data.pipeline."
                                              r"tokenizer\) was not found in .*: pass --tokenizer PATH$"):
        run_tokenizer(step, pipeline)
    assert run_tokenizer(step, synthetic) is None and run_tokenizer(step, None) is None
    (tmp_path / "repo" / "data").mkdir()
    shutil.copy(sp, tmp_path / "repo" / "data" / "tok.model")  # relative to the repository the run was in
    assert run_tokenizer(step, pipeline) == tmp_path / "repo" / "data" / "tok.model"
    imported = tmp_path / "repo" / "runs" / "r" / "hf_import"
    imported.mkdir()
    shutil.copy(sp, imported / "tokenizer.model")
    assert run_tokenizer(step, synthetic) == imported / "tokenizer.model"
    # fbt generate on an import trained on synthetic data finds the import's tokenizer (before: "pass --tokenizer")
    assert find_tokenizer(synthetic, step).get_piece_size() == 300
    (imported / "tokenizer.json").write_text("{}")
    assert run_tokenizer(step, synthetic) == imported  # a Hugging Face tokenizer: its folder
    shutil.copy(sp, step / "tokenizer.model")
    assert run_tokenizer(step, synthetic) == step / "tokenizer.model"  # the checkpoint's own copy first
    (step / "tokenizer.json").write_text("{}")
    assert run_tokenizer(step, pipeline) == step
