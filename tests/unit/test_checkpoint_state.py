"""CheckpointState: callbacks' states are keyed by ``state_key`` (else the class name); one key twice is refused."""

from __future__ import annotations

import pytest

from fbt_megatron.checkpoint.state import CheckpointState
from fbt_megatron.passes import PassSchedule
from fbt_megatron.recipe import Recipe
from fbt_megatron.train.trainer import TrainState
from tests.support.training import tiny_recipe


class Counter:
    def __init__(self, n=0, state_key=None):
        self.n = n
        if state_key is not None:
            self.state_key = state_key

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _state(callbacks):
    recipe = Recipe.model_validate(tiny_recipe("run"))
    return CheckpointState(train_state=TrainState(), pass_schedule=PassSchedule(recipe.schedule), recipe=recipe,
                         layout={}, callbacks=callbacks)


def test_two_callbacks_of_one_class_are_refused_naming_it():
    with pytest.raises(ValueError, match="'Counter'.*state_key"):
        _state([Counter(1), Counter(2)])


def test_state_key_tells_instances_apart_and_round_trips():
    saved = _state([Counter(1, "a"), Counter(2, "b"), Counter(3)]).state_dict()
    assert saved["callbacks"] == {"a": {"n": 1}, "b": {"n": 2}, "Counter": {"n": 3}}
    loaded = [Counter(0, "b"), Counter(0, "a"), Counter(0)]
    state = _state([])
    state.load_state_dict(saved)
    state.add_callbacks(loaded)
    assert [cb.n for cb in loaded] == [2, 1, 3]


def test_a_model_without_fusion_resumes_counting_every_step_one_pass():
    """Checkpoints of a model without a fusion, saved before its schedule said so, count the mix's draws
    (steps that ran one pass each): loaded, they count one pass; a model with a fusion keeps its counts."""
    recipe = Recipe.model_validate(tiny_recipe("run"))
    saved = _state([]).state_dict()
    saved["train_state"]["pass_counts"] = {"1": 5, "2": 3, "3": 1}
    for feedback, want in ((False, {"1": 9}), (True, {"1": 5, "2": 3, "3": 1})):
        state = CheckpointState(train_state=TrainState(), pass_schedule=PassSchedule(recipe.schedule, feedback=feedback),
                                recipe=recipe, layout={})
        state.load_state_dict(saved)
        assert state.train_state.pass_counts == want
