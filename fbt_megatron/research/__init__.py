"""Small-scale reproductions of the paper's mechanisms (layer-0 probes, the fixed point, data
efficiency, FUSED prefill). The re-runnable commands are in ``tools/``; this package holds what they
share and what the tests check: the synthetic task generators, the stability estimators and the
linear probes."""
