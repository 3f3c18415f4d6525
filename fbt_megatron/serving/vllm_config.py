"""The plugin's per-architecture config hook (vLLM's ``VerifyAndUpdateConfig``, run when an engine's config is
built): a K-pass (FUSED) prefill is defined over a whole prompt, so the prompt must reach the model in one
step. Prefix caching (which would resume a prompt after a cached prefix) and chunked prefill (which would
split it) are switched off, with a log line; the exact prefill needs neither switched off."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

log = logging.getLogger("fbt_megatron.serving")


class FBTVllmConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        from fbt_megatron.serving.vllm_model import check_servable

        hf = vllm_config.model_config.hf_config
        check_servable(hf)
        if getattr(hf, "feedback_fusion", "glu") == "off" or getattr(hf, "feedback_decoding", "feedback") == "standard":
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
