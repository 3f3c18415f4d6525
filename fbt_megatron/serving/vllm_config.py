"""The plugin's per-architecture config hook (vLLM's ``VerifyAndUpdateConfig``, run when an engine's config is
built): a K-pass (FUSED) prefill is defined over a whole prompt, so the prompt must reach the model in one
step. Prefix caching (which would resume a prompt after a cached prefix) and chunked prefill (which would
split it) are switched off, with a log line; the exact prefill needs neither switched off.

Eager mode is forced for every FBT model whose forward is not the plain Llama stack: ``FBTForCausalLM.forward``
reads tensors on the host (``.item()``, ``bool()``), loops in Python over passes and takes another path when
vLLM's attention metadata is missing (warm-up, profiling). CUDA graphs or torch.compile would capture the
warm-up path and replay it for real steps (wrong tokens, silently); ``model_config.enforce_eager = True`` makes
vLLM set ``compilation_config.mode = CompilationMode.NONE`` and ``cudagraph_mode = CUDAGraphMode.NONE`` (vLLM
0.32 applies it after this hook, in ``VllmConfig.__post_init__``); the hook also sets both itself."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

log = logging.getLogger("fbt_megatron.serving")


class FBTVllmConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        from fbt_megatron.serving.vllm_model import check_servable, refuse_lora

        hf = vllm_config.model_config.hf_config
        check_servable(hf)
        refuse_lora(vllm_config)  # here too: refused in the front end, before an engine core starts
        fusion = getattr(hf, "feedback_fusion", "glu")
        decoding = getattr(hf, "feedback_decoding", "feedback")
        plain_stack = fusion == "off" or (decoding == "standard"
                                          and getattr(hf, "feedback_first_input", "embedding") == "embedding")
        if not plain_stack:
            force_eager(vllm_config)
        if fusion == "off" or decoding == "standard":
            return
        if getattr(hf, "prefill_passes", 2) == "exact":
            return
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        if cache.enable_prefix_caching:
            log.warning("fbt_megatron plugin: prefix caching off (prefill_passes=%s runs its passes over the "
                        "whole prompt; prefill_passes='exact' allows it)", hf.prefill_passes)
            cache.enable_prefix_caching = False
        if sched.enable_chunked_prefill:
            max_len = vllm_config.model_config.max_model_len
            if sched.max_num_batched_tokens < max_len:
                sched.max_num_batched_tokens = max_len
            log.warning("fbt_megatron plugin: chunked prefill off, max_num_batched_tokens=%d (prefill_passes=%s "
                        "runs its passes over the whole prompt; prefill_passes='exact' allows chunks)",
                        sched.max_num_batched_tokens, hf.prefill_passes)
            sched.enable_chunked_prefill = False


def force_eager(vllm_config) -> None:
    """No CUDA graphs, no torch.compile: the FBT forward is host-driven (see the module docstring)."""
    model_config, comp = vllm_config.model_config, getattr(vllm_config, "compilation_config", None)
    was = (model_config.enforce_eager, getattr(comp, "mode", None), getattr(comp, "cudagraph_mode", None))
    model_config.enforce_eager = True
    if comp is not None:
        from vllm.config.compilation import CompilationMode, CUDAGraphMode

        if hasattr(comp, "mode"):
            comp.mode = CompilationMode.NONE
        if hasattr(comp, "cudagraph_mode"):
            comp.cudagraph_mode = CUDAGraphMode.NONE
    if not was[0]:
        log.warning("fbt_megatron plugin: eager mode forced (enforce_eager=True, no CUDA graphs, no "
                    "torch.compile; was compilation mode=%s, cudagraph_mode=%s): the FBT forward reads tensors "
                    "on the host and takes another path in warm-up runs", was[1], was[2])
