"""Invalid sizes and modes fail at construction, naming the field and what is allowed."""

import pytest
import torch
from pydantic import ValidationError

from fbt_megatron.config import FeedbackConfig, ModelConfig, PassScheduleConfig
from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import DistributedTestFailure, run_distributed
from tests.support.model_helpers import feedback, tiny_model_config


def build_tp2_with_hidden_27():
    build_model(ModelConfig(num_layers=1, hidden_size=27, num_attention_heads=3, vocab_size=64), FeedbackConfig())


@pytest.mark.slow  # two gloo processes
def test_hidden_not_divisible_by_tp():
    with pytest.raises(DistributedTestFailure, match=r"model.hidden_size=27 is not divisible by tensor parallel size 2; allowed: multiples of 2"):
        run_distributed(build_tp2_with_hidden_27, 2, layout=ParallelLayout(tensor=2))


def test_unknown_fusion_mode():
    with pytest.raises(ValidationError, match=r"fusion='gated' is not one of \('glu', 'additive', 'off'\)"):
        FeedbackConfig(fusion="gated")


def test_unknown_grad_mode_and_key():
    with pytest.raises(ValidationError, match=r"grad_mode"):
        FeedbackConfig(grad_mode="some")
    with pytest.raises(ValidationError, match=r"jitter\b"):
        FeedbackConfig(jitter=0.1)  # extra keys are refused by name


@pytest.mark.parametrize("mix", [[0.75, 0.22], [1.2, -0.2], []])
def test_mix_must_be_a_distribution(mix):
    with pytest.raises(ValidationError, match=r"schedule.mix"):
        PassScheduleConfig(mix=mix)


def test_heads_must_divide_hidden():
    with pytest.raises(ValidationError, match=r"hidden_size=30 must be divisible by model.num_attention_heads=4"):
        ModelConfig(hidden_size=30, num_attention_heads=4)


@pytest.mark.parametrize("k", [0, -1])
def test_num_passes_below_one(single_process, k):
    model = build_model(tiny_model_config(), feedback())
    with pytest.raises(ValueError, match=r"num_passes=.* allowed: an integer >= 1"):
        model(torch.zeros(1, 4, dtype=torch.long), num_passes=k)


def test_world_not_divisible_by_layout():
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tensor\*pipeline\*context = 2"):
        ParallelLayout(tensor=2).data(3)
