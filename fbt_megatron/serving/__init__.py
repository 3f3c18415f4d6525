"""Serving exports with vLLM: the latent-feedback model plugin (``vllm_plugin``, ``vllm_model``).

Nothing here is imported by the rest of fbt_megatron; the plugin imports only torch and vLLM, so it runs
in a vLLM environment without Megatron or DeepSpeed (docs/serving.md).
"""
