"""The torch norms of Megatron's local layers (fbt_megatron/model/norms.py): torch's own RMSNorm in the
Llama-shaped model, and what only apex's or Transformer Engine's norms do refused by name."""

import pytest
import torch

from fbt_megatron.model import norms
from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import LLAMA, feedback, tiny_model_config


def test_model_uses_torchs_rmsnorm(single_process):
    """Every RMSNorm of the Llama-shaped model (layers and final) is torch's own."""
    model = build_model(tiny_model_config(**LLAMA), feedback(fusion="glu"))
    rms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(rms) == 2 * LLAMA["num_layers"] + 1 and all(type(m) is torch.nn.RMSNorm for m in rms)


@pytest.mark.parametrize("option", ["layernorm_zero_centered_gamma", "persist_layer_norm",
                                    "memory_efficient_layer_norm"])
def test_torch_norm_refuses_what_only_apex_or_te_norms_do(single_process, option):
    """What Megatron's WrappedTorchNorm asserts against, refused with the option's name (zero-centred gamma
    would otherwise be silently the wrong formula)."""
    from fbt_megatron.model.fbt_gpt import transformer_config

    config = transformer_config(tiny_model_config(**LLAMA))
    assert type(norms.TorchNorm(config, 32)) is torch.nn.RMSNorm
    setattr(config, option, True)
    with pytest.raises(ValueError, match=option):
        norms.TorchNorm(config, 32)
