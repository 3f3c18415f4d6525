"""Where this rank's share of the fp32 training state lives inside DeepSpeed, at every ZeRO stage.

A parameter's TP-local tensor is, under ZeRO, split over the data-parallel ranks as a contiguous range
of its flattened elements, and DeepSpeed tells each rank its range:

* ZeRO-1/2 and DeepSpeed's bf16 optimiser: ``param._hp_mapping`` (``lp_fragment_address`` = start and
  length in the flattened parameter, ``hp_fragment`` = the fp32 master slice, ``get_optim_state_fragment``
  = the AdamW moments' slices). ``_hp_mapping is None`` means the partition lives on other DP ranks.
* ZeRO-3: rank ``r`` owns ``[r * partition, (r + 1) * partition)`` of every parameter (``ds_tensor``);
  ``get_local_fp32_param`` gives the fp32 master and moment slices of that partition.
* ZeRO-0: every DP rank holds the whole tensor (fp32: the parameter and ``optimizer.state[p]``; bf16:
  the optimiser's fp32 copy ``fp32_groups`` of the bf16 parameter).

The checkpoint (:mod:`fbt_megatron.checkpoint.shards`) turns these slices into ShardedTensor pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")  # "param" = the fp32 master weights


@dataclass
class LocalSlice:
    """``[start, start + numel)`` of a flattened TP-local parameter: flat fp32 views of the master weights
    and moments (``tensors[name]``), and whether every DP rank holds the same (ZeRO-0)."""
    start: int
    numel: int
    tensors: dict[str, torch.Tensor]
    dp_replicated: bool


class ZeroState:
    """Views of this rank's fp32 master weights and AdamW moments inside an :class:`~fbt_megatron.engine.Engine`."""

    def __init__(self, engine):
        self.engine = engine
        self.ds_optimizer = engine.ds.optimizer
        self.torch_optimizer = engine.torch_optimizer
        self.zero_stage = engine.zero_stage
        self._lp_to_fp32 = self._unfused_fp32_copies()

    def _unfused_fp32_copies(self) -> dict[int, torch.Tensor]:
        """ZeRO-0 with bf16: DeepSpeed's FP16_UnfusedOptimizer keeps an fp32 copy per parameter."""
        opt = self.ds_optimizer
        if not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")):
            return {}
        return {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}

    def local_slice(self, p: torch.nn.Parameter, local_numel: int) -> LocalSlice | None:
        """This rank's slice of ``p`` (``local_numel`` elements TP-local); None: other DP ranks hold it."""
        if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition of p
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            from megatron.core import parallel_state as ps

            part = p.ds_tensor.ds_numel
            start = ps.get_data_parallel_rank() * part
            numel = max(0, min(local_numel - start, part))
            tensors = {"param": safe_get_local_fp32_param(p)}
            for k in STATE_NAMES[1:]:
                tensors[k] = safe_get_local_optimizer_state(p, k)
            return LocalSlice(start, numel, {k: v.reshape(-1)[:numel] for k, v in tensors.items()}, False)
        if hasattr(p, "_hp_mapping"):  # ZeRO-1/2 or the bf16 optimiser: a slice of the flat partition
            m = p._hp_mapping
            if m is None:
                return None
            tensors = {"param": m.hp_fragment}
            for k in STATE_NAMES[1:]:
                tensors[k] = m.get_optim_state_fragment(k)
            a = m.lp_fragment_address
            return LocalSlice(a.start, a.numel, {k: v.reshape(-1) for k, v in tensors.items()}, False)
        master = self._lp_to_fp32.get(id(p), p)  # ZeRO-0: the whole tensor on every DP rank
        state = self.torch_optimizer.state[master]
        tensors = {"param": master.data, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        return LocalSlice(0, local_numel, {k: v.reshape(-1) for k, v in tensors.items()}, True)

    @torch.no_grad()
    def masters_to_model(self, params: list[torch.nn.Parameter]) -> None:
        """After loading the fp32 masters: refresh the model's (lp) parameters from them, the way
        DeepSpeed does after an optimiser step (ZeRO-1/2/bf16: copy the partition, all-gather over DP;
        ZeRO-3: the rank's ``ds_tensor`` partition; ZeRO-0 bf16: copy each fp32 copy)."""
        opt = self.ds_optimizer
        if self.zero_stage in (1, 2) or hasattr(opt, "update_lp_params") and any(
                hasattr(p, "_hp_mapping") for p in params):
            opt.update_lp_params()
        for p in params:
            if hasattr(p, "ds_id"):
                from deepspeed.utils import safe_get_local_fp32_param

                hp = safe_get_local_fp32_param(p).reshape(-1)
                p.ds_tensor.data.reshape(-1).copy_(hp[: p.ds_tensor.numel()].to(p.ds_tensor.dtype))
            elif id(p) in self._lp_to_fp32:
                p.data.copy_(self._lp_to_fp32[id(p)].data.to(p.dtype))

    def optimizer_steps(self) -> int:
        return self.engine.optimizer_steps()

    def set_optimizer_step(self, steps: int) -> None:
        self.engine.set_optimizer_step(steps)
