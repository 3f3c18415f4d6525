"""Tokenizer, WebDataset shard writer and the streaming token-mix loader (``fbt data ...``)."""
