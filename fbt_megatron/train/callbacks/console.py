"""Console progress lines: loss, loss by pass count, lr, grad norm, tokens/s, MFU, pass mix; and the
validation losses."""

from __future__ import annotations

from fbt_megatron.train.callbacks.base import Logger, is_rank0, log_info


def model_flops_per_token(matmul_params: int, num_layers: int, hidden: int, seq_len: int, passes: int,
                          grad_mode: str = "all", fusion_params: int = 0, fused_first_pass: bool = False) -> float:
    """Training FLOPs per token of a ``passes``-pass step, counted as ``fbt plan`` counts them: a
    forward of the stack F = 2 N_mm + 4 L S h (matmul parameters without the fusion; QK^T and AV over
    the full square) and of the fusion 2 x ``fusion_params`` (W_U, W_G), combined by
    ``passes.step_flops`` (the fusion only in the passes that read a state)."""
    from fbt_megatron.passes import step_flops

    stack = 2.0 * matmul_params + 4.0 * num_layers * hidden * seq_len
    return step_flops(passes, grad_mode, stack, 2.0 * fusion_params, fused_first_pass)


def attention_flops_per_pair(num_layers: int, hidden: int, passes: int, grad_mode: str = "all") -> float:
    """Training FLOPs per attended (query, key) pair of a ``passes``-pass step: QK^T and AV, 2h each per
    layer and forward, through the forwards and backwards ``passes.step_flops`` counts."""
    from fbt_megatron.passes import step_flops

    return step_flops(passes, grad_mode, 4.0 * num_layers * hidden, 0.0)


def causal_pairs(cu_seqlens) -> int:
    """(query, key) pairs of causal attention over the sequences ``cu_seqlens`` delimits: d(d+1)/2 each."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    return sum(d * (d + 1) // 2 for d in lengths)


class ConsoleLogger(Logger):
    """Every N steps: loss, loss by pass count, lr, grad norm, tokens/s, MFU, pass mix so far.
    ``flops_fn(step_result)``: the step's training FLOPs; the MFU counts attention causally (the pairs
    the mask lets through: d(d+1)/2 per packed document), which the line says, not the full square
    ``fbt plan`` counts."""

    priority = 90

    def __init__(self, every: int, flops_fn=None, peak_flops: float | None = None, world_size: int = 1,
                 print_fn=log_info):
        self.every, self.flops_fn, self.peak_flops = every, flops_fn, peak_flops
        self.world_size, self.print = world_size, print_fn
        self._window: list = []

    def on_step_end(self, trainer, r) -> None:
        self._window.append(r)
        if trainer.state.step % self.every and trainer.state.step != trainer.total_steps:
            return
        w, self._window = self._window, []
        good = [x for x in w if not x.skipped]
        secs = sum(x.seconds for x in w) or 1e-9
        tokens = sum(x.tokens for x in w)
        by_k: dict[int, list[float]] = {}
        for x in good:
            by_k.setdefault(x.num_passes, []).append(x.loss)
        split = " ".join(f"k{k}={sum(v) / len(v):.4f}" for k, v in sorted(by_k.items()))
        loss = sum(x.loss for x in good) / len(good) if good else float("nan")
        mix = trainer.state.pass_counts
        total = sum(mix.values()) or 1
        mix_s = "/".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(mix.items()))
        gn = [x.grad_norm for x in good if x.grad_norm is not None]
        line = (f"step {trainer.state.step:>6d}/{trainer.total_steps} | loss {loss:.4f} [{split}] | "
                f"lr {w[-1].lr:.3e} | gnorm {(gn[-1] if gn else float('nan')):.3f} | "
                f"{tokens / secs:,.0f} tok/s")
        if self.peak_flops and self.flops_fn:
            flops = sum(self.flops_fn(x) for x in w)
            line += f" | MFU {100 * flops / secs / (self.peak_flops * self.world_size):.2f}% (causal attention)"
        if w[-1].residuals:
            line += " | resid " + ",".join(f"{v:.3f}" for v in w[-1].residuals)
        line += f" | passes {mix_s}"
        if trainer.state.skipped_steps:
            line += f" | skipped {trainer.state.skipped_steps}"
        trainer.metrics["tokens_per_s"] = tokens / secs
        if is_rank0():
            self.print(line, flush=True)

    def log_metrics(self, trainer, metrics: dict) -> None:
        """The validation losses (``val/loss_kK``) as one line."""
        losses = {int(k[len("val/loss_k"):]): v for k, v in metrics.items() if k.startswith("val/loss_k")}
        if losses and is_rank0():
            body = " ".join(f"{k}-pass {v:.4f}" for k, v in losses.items())
            self.print(f"validation @ step {trainer.state.step}: {body}", flush=True)
