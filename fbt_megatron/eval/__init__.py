"""Evaluation: the lm-eval model ``fbt``, pass@k, sandboxed code execution, ``fbt eval`` tables."""
