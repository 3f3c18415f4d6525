"""What each rank owns of the training state, as pieces of Megatron ShardedTensors.

A parameter's *TP-local* tensor (shape ``local_shape``, placed in the global tensor by the TP metadata of
the model's ``sharded_state_dict()``) is, under ZeRO, further split over the data-parallel ranks as a
contiguous range of its flattened elements. DeepSpeed tells each rank its range directly:

* ZeRO-1/2 and DeepSpeed's bf16 optimiser: ``param._hp_mapping`` (``lp_fragment_address`` = start and
  length in the flattened parameter, ``hp_fragment`` = the fp32 master slice, ``get_optim_state_fragment``
  = the AdamW moments' slices). ``_hp_mapping is None`` means the partition lives on other DP ranks.
* ZeRO-3: rank ``r`` owns ``[r * partition, (r + 1) * partition)`` of every parameter (``ds_tensor``);
  ``get_local_fp32_param`` gives the fp32 master and moment slices of that partition.
* ZeRO-0: every DP rank holds the whole tensor (fp32: the parameter and ``optimizer.state[p]``; bf16:
  the optimiser's fp32 copy ``fp32_groups`` of the bf16 parameter). Only DP rank 0 writes it.

Megatron 0.16's torch_dist format no longer takes ``flattened_range``, but it stores unevenly sharded
tensors (several local pieces per key, ``axis_fragmentations=None``). A flat range of an N-d tensor is a
union of at most ``2 * ndim - 1`` rectangles (partial first row, whole rows, partial last row, recursively),
so :func:`flat_range_boxes` turns each rank's range into rectangles and each rectangle becomes a
ShardedTensor piece whose data is a *view* of DeepSpeed's own buffer (nothing is copied to save, and
loading reads straight into the buffers). On load PyTorch DCP reads, for every requested rectangle, the
overlapping bytes of the stored rectangles, whatever layout wrote them: that is the resharding.

Every value is fp32 (the master weights, never bf16 copies), keyed by the model's ShardedTensor key
(``optimizer.exp_avg.<key>`` and ``optimizer.exp_avg_sq.<key>`` for the moments). Those keys carry
global layer numbers, so pipeline stages map to the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def storage_key(template_key: str, which: str) -> str:
    return template_key if which == "param" else f"optimizer.{which}.{template_key}"


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangles ``(offset, size)`` that tile the row-major flat range ``[start, stop)`` of ``shape``,
    in flat order."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return [((first,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], start - first * inner,
                                                                        stop - first * inner)]
    boxes = []
    full_from = first
    if start % inner:
        boxes += [((first,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], start % inner, inner)]
        full_from = first + 1
    full_to = stop // inner
    if full_to > full_from:
        boxes.append(((full_from,) + (0,) * (len(shape) - 1), (full_to - full_from,) + tuple(shape[1:])))
    if stop % inner:
        boxes += [((full_to,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], 0, stop % inner)]
    return boxes


@dataclass
class ParamSpec:
    """A trainable parameter and its place in the checkpoint (from the model's sharded_state_dict)."""
    name: str  # module path, for messages
    param: torch.nn.Parameter
    key: str  # ShardedTensor key (global layer numbers)
    local_shape: tuple[int, ...]  # TP-local shape
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    replica_id: tuple  # the template's (PP, TP, DP) replica id
    # Set when the TP-local rows are not one block of the global tensor (a ShardedTensorFactory: the
    # SwiGLU fc1's [gate; up] halves, the padded vocabulary's logical chunks): (local row, rows, global
    # row) segments along the first non-prepended axis; local rows in no segment (padding) are not saved.
    row_map: tuple | None = None


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """Built from ``model.sharded_state_dict()`` before DeepSpeed wraps the model (ZeRO-3 empties the
    parameters afterwards). A parameter missing from it is saved as a TP-replicated tensor."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    by_id = {}
    for value in model.sharded_state_dict().values():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.nn.Parameter):
            by_id[id(value.data)] = value
    specs = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tpl = by_id.get(id(p))
        if isinstance(tpl, ShardedTensorFactory):
            specs.append(_factory_spec(name, p, tpl))
            continue
        if tpl is None:
            tpl = ShardedTensor.from_rank_offsets(name, p.detach(), replica_id=(
                0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True)))
        rid = tpl.replica_id if isinstance(tpl.replica_id, tuple) else (0, 0, tpl.replica_id)
        specs.append(ParamSpec(name, p, tpl.key, tuple(tpl.local_shape), tuple(tpl.global_shape),
                               tuple(tpl.global_offset), tpl.prepend_axis_num, tuple(rid)))
    return specs


def _factory_spec(name: str, p: torch.nn.Parameter, factory) -> ParamSpec:
    """A factory's pieces are views of row blocks of the parameter: record where each block goes."""
    subs = factory.build()
    row_bytes = p.stride(0) * p.element_size()
    segments, first = [], None
    for sub in subs:
        same_storage = sub.data.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        if not same_storage:  # a placeholder (e.g. a rank holding only vocabulary padding)
            first = first or sub
            continue
        first = sub
        ax = sub.prepend_axis_num
        local_row = (sub.data.data_ptr() - p.data_ptr()) // row_bytes
        segments.append((local_row, sub.data.shape[0], sub.global_offset[ax]))
    if first is None:
        raise ValueError(f"{name}: its checkpoint factory built no pieces")
    rid = factory.replica_id if isinstance(factory.replica_id, tuple) else (0, 0, factory.replica_id)
    ax = first.prepend_axis_num  # prepended axes (the layer number) keep the template's offsets
    goff = tuple(first.global_offset[:ax]) + (0,) * (len(first.global_shape) - ax)
    return ParamSpec(name, p, factory.key, tuple(p.shape), tuple(first.global_shape),
                     goff, ax, tuple(rid), tuple(segments))


def _row_split(spec: ParamSpec, off: tuple, size: tuple):
    """A local box -> [(local offset, size, global offset)] through the spec's row map."""
    p = spec.prepend_axis_num
    if spec.row_map is None:
        return [(off, size, spec.global_offset[:p] + tuple(g + o for g, o in zip(spec.global_offset[p:], off)))]
    out = []
    for local_row, rows, global_row in spec.row_map:
        r0, r1 = max(off[0], local_row), min(off[0] + size[0], local_row + rows)
        if r0 < r1:
            o = (r0,) + tuple(off[1:])
            out.append((o, (r1 - r0,) + tuple(size[1:]),
                        tuple(spec.global_offset[:p]) + (global_row + r0 - local_row,) + tuple(off[1:])))
    return out


@dataclass
class Fragment:
    """This rank's slice ``[start, start + numel)`` of a flattened TP-local parameter: flat fp32 views of
    the master weights and moments (``tensors[which]``), and whether another DP rank holds the same."""
    spec: ParamSpec
    start: int
    numel: int
    tensors: dict[str, torch.Tensor]
    dp_replicated: bool  # ZeRO-0: every DP rank has it, DP rank 0 writes

    def pieces(self, dp_rank: int, clone: bool = False) -> dict[str, list]:
        """ShardedTensor pieces of this fragment, ``{storage_key: [ShardedTensor, ...]}``."""
        from megatron.core.dist_checkpointing import ShardedTensor

        s = self.spec
        pp, tp, dp = s.replica_id
        replica = (pp, tp, dp_rank if self.dp_replicated else 0)
        out = {}
        for which, flat in self.tensors.items():
            key = storage_key(s.key, which)
            out[key] = []
            boxes = [piece for box in flat_range_boxes(s.local_shape, self.start, self.start + self.numel)
                     for piece in _row_split(s, *box)]
            for off, size, goff in boxes:
                begin = _flat_index(s.local_shape, off) - self.start
                # Prepended axes (e.g. the global layer number) become size-1 leading dims of the piece:
                # megatron's uneven-sharding path does not handle prepend_axis_num.
                p = s.prepend_axis_num
                size = (1,) * p + tuple(size)
                data = flat.narrow(0, begin, math.prod(size)).view(size)
                if clone:
                    data = data.clone()
                out[key].append(ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=size,
                                              global_shape=s.global_shape, global_offset=goff,
                                              axis_fragmentations=None, replica_id=replica))
        return out


def _flat_index(shape, offset) -> int:
    idx = 0
    for dim, o in zip(shape, offset):
        idx = idx * dim + o
    return idx


def whole_tensor_fragment(spec: ParamSpec, tensors: dict[str, torch.Tensor], dp_replicated: bool) -> Fragment:
    n = math.prod(spec.local_shape)
    return Fragment(spec, 0, n, {k: v.reshape(-1) for k, v in tensors.items()}, dp_replicated)


# ---------------------------------------------------------------------- the engine's state as fragments
class StateFragments:
    """This rank's fragments of the fp32 training state inside a DeepSpeed engine (any ZeRO stage,
    fp32 or bf16), as views: reading them saves, writing them loads. Where each slice lives inside
    DeepSpeed is the engine layer's business (:class:`fbt_megatron.engine.zero_state.ZeroState`)."""

    def __init__(self, engine, specs: list[ParamSpec]):
        from fbt_megatron.engine.zero_state import ZeroState

        self.zero, self.specs = ZeroState(engine), specs

    def fragments(self) -> list[Fragment]:
        out = []
        for spec in self.specs:
            local = self.zero.local_slice(spec.param, math.prod(spec.local_shape))
            if local is not None and local.numel > 0:
                out.append(Fragment(spec, local.start, local.numel, local.tensors, local.dp_replicated))
        return out

    def masters_to_model(self) -> None:
        self.zero.masters_to_model([s.param for s in self.specs])

    def optimizer_steps(self) -> int:
        return self.zero.optimizer_steps()

    def set_optimizer_step(self, steps: int) -> None:
        self.zero.set_optimizer_step(steps)
