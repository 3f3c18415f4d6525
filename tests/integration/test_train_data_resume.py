"""Training on the real data pipeline: a checkpoint records the loader's global cursor, a resume
continues the same samples exactly, and a resume under a changed data stream is refused."""

import pytest

from tests.support.data_fixtures import build_fixture, fixture_config
from tests.support.distributed import DistributedTestFailure, run_distributed
from tests.support.training import losses, tiny_recipe, train_fn


@pytest.fixture(scope="module")
def data_section(tmp_path_factory):
    fx = build_fixture(tmp_path_factory.mktemp("data"))
    return fixture_config(fx, seq_length=32).model_dump(mode="json")


def recipe(run_dir, data_section, **sections):
    model = {"vocab_size": 320}  # the fixture tokenizer's vocabulary
    return tiny_recipe(run_dir, data={"source": "pipeline", "pipeline": data_section}, model=model, **sections)


def test_resume_continues_the_same_samples_and_refuses_a_changed_stream(tmp_path, data_section):
    straight = run_distributed(train_fn, 1, recipe(tmp_path / "a", data_section, train={"steps": 6}))[0]

    first = recipe(tmp_path / "b", data_section, train={"steps": 6, "stop_at_step": 3}, checkpoint={"at_end": True})
    run_distributed(train_fn, 2, first)  # DP=2 for the first half
    resumed = run_distributed(train_fn, 1, recipe(tmp_path / "b", data_section, train={"steps": 6}))[0]
    assert resumed["history"][0][0] == 3
    assert losses(resumed) == pytest.approx(losses(straight)[3:], abs=1e-5)

    changed = dict(data_section, seed=data_section["seed"] + 1)
    with pytest.raises(DistributedTestFailure, match=r"seed"):
        run_distributed(train_fn, 1, recipe(tmp_path / "b", changed, train={"steps": 8}))
