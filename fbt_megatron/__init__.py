"""fbt_megatron: full-bandwidth transformers (latent feedback) on Megatron-Core and DeepSpeed."""

__version__ = "0.1.0"
