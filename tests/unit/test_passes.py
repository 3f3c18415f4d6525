"""The pass schedule: deterministic from (seed, step), so the same on every rank and after restart."""


from fbt_megatron.config import PassScheduleConfig
from fbt_megatron.passes import PassSchedule


def draws(seed=5, start=100, steps=3000):
    schedule = PassSchedule(PassScheduleConfig(feedback_start_step=start, seed=seed))
    return [schedule.num_passes(s) for s in range(steps)]


def test_single_pass_until_switch_then_mix():
    seq = draws(start=100)
    assert set(seq[:100]) == {1}
    assert set(seq[100:]) == {1, 2, 3}


def test_identical_after_restart_from_any_step():
    """A pure function of (seed, step): a fresh object, in a process whose global random generators are
    elsewhere (another rank, a restarted job), draws the same k. The schedule takes no rank, so this is
    also what makes every rank draw alike."""
    import random

    import numpy as np
    import torch

    full = draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    resumed = PassSchedule(PassScheduleConfig(feedback_start_step=100, seed=5))  # a fresh process's object
    assert [resumed.num_passes(s) for s in range(1700, 3000)] == full[1700:]
    assert draws(seed=6) != full  # the seed matters


def test_mix_over_10000_steps_within_one_point():
    counts = PassSchedule(PassScheduleConfig(feedback_start_step=0, seed=0)).counts(0, 10_000)
    for k, target in {1: 0.75, 2: 0.22, 3: 0.03}.items():
        assert abs(counts.get(k, 0) / 10_000 - target) <= 0.01, counts


def test_custom_mix_with_a_deeper_pass():
    schedule = PassSchedule(PassScheduleConfig(mix=[0.5, 0.0, 0.0, 0.5]))
    assert schedule.max_passes == 4
    assert set(schedule.counts(0, 500)) == {1, 4}


def _recipe(**overrides):
    from fbt_megatron.recipe import Recipe
    from tests.support.training import tiny_recipe

    data = tiny_recipe("run")
    data["schedule"].pop("seed")
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return Recipe.model_validate(data)


def test_schedule_seed_follows_the_recipe_seed_unless_set():
    assert _recipe(seed=7).schedule.seed == 7
    assert _recipe(seed=8).schedule.seed == 8
    assert _recipe(seed=7, schedule={"seed": 3}).schedule.seed == 3
    # two seeds draw two different pass sequences (the default 0 used to give every seed the same one)
    a, b = (PassSchedule(_recipe(seed=s, schedule={"feedback_start_step": 0}).schedule) for s in (7, 8))
    assert [a.num_passes(s) for s in range(300)] != [b.num_passes(s) for s in range(300)]


def test_a_checkpoint_keeps_the_schedule_seed_it_was_trained_with():
    """A run saved before schedule.seed followed the recipe's seed drew with seed 0: resumed without a
    schedule.seed in its recipe, it keeps drawing with 0; a recipe that sets the seed wins."""
    from fbt_megatron.checkpoint.state import CheckpointState
    from fbt_megatron.train.trainer import TrainState

    def resumed(recipe, saved_seed):
        saved = CheckpointState(train_state=TrainState(), pass_schedule=PassSchedule(recipe.schedule), recipe=recipe,
                              layout={}).state_dict()
        saved["pass_schedule"]["seed"] = saved_seed
        schedule = PassSchedule(recipe.schedule)
        CheckpointState(train_state=TrainState(), pass_schedule=schedule, recipe=recipe, layout={}).load_state_dict(saved)
        return schedule

    old = resumed(_recipe(seed=1234, schedule={"feedback_start_step": 0}), 0)
    assert old.config.seed == 0
    trained = PassSchedule(PassScheduleConfig(feedback_start_step=0, mix=old.config.mix, seed=0))
    assert [old.num_passes(s) for s in range(500)] == [trained.num_passes(s) for s in range(500)]
    assert old.state_dict()["seed"] == 0  # and the next checkpoint records it
    assert resumed(_recipe(seed=1234, schedule={"feedback_start_step": 0, "seed": 5}), 0).config.seed == 5


def test_max_passes_is_the_deepest_count_with_a_nonzero_probability():
    """Evaluation runs ``max_passes`` deep (train/run.py): a mix whose trailing entries are 0 never trains
    those depths, so they do not count."""
    assert PassSchedule(PassScheduleConfig(mix=[0.75, 0.25, 0.0])).max_passes == 2
    assert PassSchedule(PassScheduleConfig(mix=[1.0, 0.0, 0.0])).max_passes == 1
    assert PassSchedule(PassScheduleConfig(mix=[0.0, 0.0, 1.0])).max_passes == 3


def test_the_switch_step_itself_draws_from_the_mix():
    """``feedback_start_step`` is the first step of the feedback phase: with a mix that always draws 2
    passes, the step before it is single-pass and the step itself is not."""
    schedule = PassSchedule(PassScheduleConfig(feedback_start_step=7, mix=[0.0, 1.0], seed=3))
    assert [schedule.num_passes(s) for s in range(5, 10)] == [1, 1, 2, 2, 2]
    assert schedule.counts(0, 10) == {1: 7, 2: 3}


def test_step_flops_count_every_pass_and_the_fused_ones():
    """In units of one forward (backward = 2 forwards): grad_mode 'all' runs k forwards and k backwards,
    'last' k forwards and the last pass's backward. The fusion runs in passes 2..k (pass 1 reads the token
    embedding) unless the first pass is fused too, and is backpropagated with its pass."""
    from fbt_megatron.passes import fusion_forwards, step_flops, step_forwards

    stack, fusion = 10.0, 1.0
    for k in (1, 2, 3):
        assert step_forwards(k, "all") == 3 * k and step_forwards(k, "last") == k + 2
        assert fusion_forwards(k, "all") == 3 * (k - 1)
        assert fusion_forwards(k, "last") == (k - 1) + (2 if k > 1 else 0)
        assert fusion_forwards(k, "all", fused_first_pass=True) == 3 * k
        assert fusion_forwards(k, "last", fused_first_pass=True) == k + 2
        assert step_flops(k, "all", stack, fusion) == 3 * k * stack + 3 * (k - 1) * fusion
        assert step_flops(k, "last", stack, fusion, fused_first_pass=True) == (k + 2) * (stack + fusion)


def test_without_feedback_every_step_is_one_pass():
    config = PassScheduleConfig(feedback_start_step=0, seed=0, mix=[0.2, 0.5, 0.3])
    schedule = PassSchedule(config, feedback=False)
    assert schedule.max_passes == 1 and schedule.counts(0, 200) == {1: 200}
    assert PassSchedule(config).counts(0, 200).keys() == {1, 2, 3}
