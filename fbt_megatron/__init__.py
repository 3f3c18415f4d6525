"""fbt_megatron: full-bandwidth transformers (latent feedback) on Megatron-Core and DeepSpeed."""

__version__ = "0.1.0"

from fbt_megatron import runtime as _runtime  # noqa: E402

_runtime.quiet_known_warnings()
