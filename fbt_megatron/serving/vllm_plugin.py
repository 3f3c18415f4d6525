"""vLLM general plugin: serves ``fbt convert to-hf`` exports (``FBTForCausalLM``) with latent feedback.

Installed with fbt_megatron (entry point ``vllm.general_plugins: fbt = fbt_megatron.serving.vllm_plugin:register``),
vLLM calls :func:`register` in each of its processes. It registers

- the model class for the ``FBTForCausalLM`` architecture (``ModelRegistry.register_model``, lazily by
  name, so importing the plugin does not import the model code);
- the export's config class for ``model_type: fbt_llama`` (``AutoConfig.register``), so an export loads
  without ``--trust-remote-code``;
- a config hook (vLLM's per-architecture ``MODELS_CONFIG_MAP``) that switches off what the FUSED prefill
  cannot follow: prefix caching and chunked prefill (see ``vllm_model``).
"""

from __future__ import annotations

ARCHITECTURE = "FBTForCausalLM"
MODEL_CLASS = "fbt_megatron.serving.vllm_model:FBTForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _register_config()
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from fbt_megatron.serving.vllm_config import FBTVllmConfig

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, FBTVllmConfig)


def _register_config() -> None:
    from transformers import AutoConfig

    from fbt_megatron.model.modeling_fbt import FBTConfig

    try:
        AutoConfig.register(FBTConfig.model_type, FBTConfig)
    except ValueError:  # already registered (register() runs once per vLLM process, maybe more)
        pass
