"""Generation with latent feedback: KV-cache decoding, prefill passes, sampling, ``fbt generate``."""
