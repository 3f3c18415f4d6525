"""DeepSpeed ZeRO (data parallelism + optimiser) over a Megatron-Core tensor-parallel model.

DeepSpeed is told about Megatron's parallel groups through :class:`MegatronMPU`, so ZeRO partitions
over the data-parallel group only, and the gradient norm counts TP-sharded parameters once per TP
rank and TP-replicated parameters once. On CPU DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over the
gloo process group that :mod:`fbt_megatron.runtime` already started; params and optimiser are fp32.
On GPU (or with ``precision: bf16`` / ``FBT_DTYPE=bf16``) the model is bf16 with fp32 master weights, fp32 gradient
accumulation and an fp32 (configurable) data-parallel reduction, as Megatron does with its fp32
main grads; see :func:`precision_config`.

The optimiser is torch's fused ``torch.optim.AdamW`` (``"torch_adam": true, "fused": true``) with two parameter groups: weight
decay on matrices, none on norms, biases and ``h_init`` (and on embeddings unless
``optimizer.decay_embeddings``). A step is skipped without touching weights, moments or Adam's step
count when the loss is non-finite (the train step says so) or the gradient is: DeepSpeed's ZeRO 1-3
and bf16 optimisers detect a non-finite gradient norm themselves; at ZeRO-0 in fp32 DeepSpeed neither
reports the norm nor checks it, so :meth:`Engine.step` computes it. The learning rate is set on the
optimiser before each step from a pure function of the step (:mod:`fbt_megatron.train.lr_schedule`), so the schedule
needs no state of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fbt_megatron import runtime
from fbt_megatron.engine.deepspeed_config import deepspeed_config, import_deepspeed
from fbt_megatron.engine.mpu import MegatronMPU
from fbt_megatron.engine.overlapped_grad_reduce import OverlappedGradReduce, reason_not_overlapped
from fbt_megatron.engine.param_groups import fusion_decay_start, fusion_weight_decay, param_groups
from fbt_megatron.engine.patches import SkippableStep, replace_zero0_clipping
from fbt_megatron.engine.sequence_parallel_grads import reduce_sequence_parallel_grads, sequence_parallel_params
from fbt_megatron.model import cpu_fastpaths


NORM_CHUNK_ELEMENTS = 1 << 16  # 512 KiB in float64: a piece's copy stays in cache, its memory is reused


def squared_l2(grad: torch.Tensor) -> torch.Tensor:
    """sum(grad**2) accumulated in float64. On CPU piece by piece: a float64 copy of a whole gradient
    and its square are two fresh allocations per parameter and step, which the CPU allocator takes
    from the OS and page-faults in every time (timings: docs/results/benchmarks.md)."""
    grad = grad.detach()
    if grad.device.type != "cpu":
        return grad.double().pow(2).sum()
    total = torch.zeros((), dtype=torch.float64)
    for piece in grad.reshape(-1).split(NORM_CHUNK_ELEMENTS):
        piece = piece.double()
        total += torch.dot(piece, piece)
    return total


def model_parallel_grad_norm(params) -> float:
    """L2 norm of the gradients of the whole model: each parameter counted once over tensor and
    pipeline parallelism (TP-replicated ones on TP rank 0, tied pipeline replicas marked
    ``ds_pipe_replicated`` not at all). A collective over the model-parallel group."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    total = torch.zeros((), dtype=torch.float64, device=runtime.device())
    for p in params:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if tp_rank > 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        total += squared_l2(p.grad)
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    return float(total.sqrt())

@dataclass
class OptimizerOutcome:
    applied: bool  # False: weights, moments and Adam's step count are untouched
    grad_norm: float | None  # global gradient norm before clipping (inf/nan when non-finite)


def _inner_optimizer(ds_optimizer):
    opt = ds_optimizer
    for _ in range(4):
        if isinstance(opt, torch.optim.Optimizer) and type(opt).__module__.startswith("torch.optim"):
            return opt
        opt = getattr(opt, "optimizer", None)
        if opt is None:
            break
    raise RuntimeError(f"cannot find the torch optimiser inside {type(ds_optimizer).__name__}")


class Engine:
    """The DeepSpeed engine plus what the trainer needs around it."""

    def __init__(self, model: torch.nn.Module, recipe):
        from megatron.core import parallel_state as ps

        deepspeed = import_deepspeed()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.zero_stage = recipe.parallel.zero_stage
        self.sequence_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))
        self.config = deepspeed_config(recipe, self.dp_size)
        self._sequence_parallel_params = sequence_parallel_params(model) if self.sequence_parallel else []
        groups = param_groups(model, recipe.optimizer.weight_decay, recipe.optimizer.decay_embeddings,
                              fusion_decay_start(recipe), fusion_in_model=recipe.feedback.fusion != "off",
                              fusion_lr_multiplier=recipe.optimizer.fusion_lr_multiplier)
        self.mpu = MegatronMPU()
        # DeepSpeed reports no gradient norm (and checks none) at ZeRO-0 in fp32: compute it here.
        self._own_grad_norm = self.zero_stage == 0 and "bf16" not in self.config
        if ps.get_pipeline_model_parallel_world_size() > 1:
            if self.zero_stage == 3:
                raise ValueError("parallel.zero_stage=3 with parallel.pipeline > 1 is not supported "
                                 "(ZeRO-3 gathers weights around the engine's forward, which a pipeline "
                                 "stage does not use); allowed: 0, 1, 2")
            self._mark_pipeline_replicas(model)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=self.config, mpu=self.mpu,
            dist_init_required=False)
        self.model = self.ds.module
        # bf16 ZeRO-1: the data-parallel all-reduce starts during the boundary backward (DeepSpeed's waits for it)
        self.overlapped_reduce = None
        if recipe.parallel.overlap_grad_reduce and reason_not_overlapped(self.ds, self.dp_size) is None:
            self.overlapped_reduce = OverlappedGradReduce(self.ds, self.dp_group,
                                                          recipe.parallel.grad_reduce_bucket_elements)
        if self.zero_stage == 3:
            self._register_shared_weights(deepspeed, self.model)
        # ZeRO-0 in fp32 over one data-parallel rank: DeepSpeed would still flatten every gradient into
        # fresh buckets, "all-reduce" them over the group of one and copy them back after each boundary
        # backward (28M parameters: a 118 MB copy there and back per step). That is an identity (sum of
        # one, divided by 1) except that it zero-fills the gradients of parameters the step did not
        # reach (the fusion in a 1-pass step), so AdamW steps them too: skipped, and the zero-fill kept
        # (:meth:`backward`).
        self._zero_fill_only = self.dp_size == 1 and self._own_grad_norm
        if self._zero_fill_only:
            self.ds.enable_backward_allreduce = False
        # ZeRO-1/2 on CPU: the room's DeepSpeed shortcuts, when installed (model/cpu_fastpaths.py).
        self.cpu_fastpaths = cpu_fastpaths.install_zero(self.ds.optimizer)
        self.torch_optimizer = _inner_optimizer(self.ds.optimizer)
        self._bf16_lp_grads_kept = type(self.ds.optimizer).__name__ == "BF16_Optimizer" and not getattr(
            self.ds.optimizer, "immediate_grad_update", False)
        self.skipper = SkippableStep(self.torch_optimizer)
        self._materialize_optimizer_state()
        self._clip_norm = None
        replace_zero0_clipping(self.ds, self._clip_fp32_gradients)

    def _materialize_optimizer_state(self) -> None:
        """Create AdamW's state (step 0, zero moments) now instead of lazily at the first step.

        torch's AdamW initialises exactly these values on its first step, so training is unchanged;
        having them early lets a resume write loaded moments into them (and ZeRO 1/2 link each
        parameter's fragment of the flat state, which the checkpoint's fragment access uses).
        """
        opt = self.torch_optimizer
        # ZeRO-3 puts its fp32 partitions into the param groups only during a step.
        zero3_flat = list(getattr(self.ds.optimizer, "fp32_partitioned_groups_flat", None) or [])
        # the fused kernel wants each step count on its parameter's device, as torch's own lazy init puts it
        on_param_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
        for p in [p for group in opt.param_groups for p in group["params"]] + zero3_flat:
            if not opt.state.get(p):
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device if on_param_device else None),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        link = getattr(self.ds.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None and self.zero_stage in (1, 2):
            link()
        elif link is not None and hasattr(self.ds.optimizer, "_hp_optimizer_states_linked"):
            link()  # DeepSpeed's BF16_Optimizer (ZeRO-1 in bf16)

    def optimizer_steps(self) -> int:
        for state in self.torch_optimizer.state.values():
            return int(state["step"])
        return 0

    def set_optimizer_step(self, steps: int) -> None:
        for state in self.torch_optimizer.state.values():
            state["step"].fill_(float(steps))

    # ------------------------------------------------------------------ step protocol
    def set_lr(self, lr: float) -> None:
        for group in self.torch_optimizer.param_groups:
            group["lr"] = lr * group.get("lr_multiplier", 1.0)

    def set_step(self, step: int) -> None:
        """Per-step optimiser settings other than the learning rate: the fusion group's weight decay
        is on from its ``decay_from_step`` (-1: never; see :func:`fusion_decay_start`)."""
        for group in self.torch_optimizer.param_groups:
            if "decay_from_step" in group:
                group["weight_decay"] = fusion_weight_decay(group["full_weight_decay"], group["decay_from_step"], step)

    def backward(self, loss: torch.Tensor, is_boundary: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(is_boundary)
        if self.overlapped_reduce is not None:
            self.overlapped_reduce.arm(is_boundary)
        # The train step already normalised the loss over the whole global batch.
        self.ds.backward(loss, scale_wrt_gas=False)
        if is_boundary and self.overlapped_reduce is not None:
            self.overlapped_reduce.finish()
        if is_boundary and self._zero_fill_only:
            for p in self.ds.module.parameters():  # what DeepSpeed's reduction does for them
                if p.requires_grad and p.numel() and p.grad is None:
                    p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
        if self._bf16_lp_grads_kept:
            # DeepSpeed's BF16_Optimizer has just added this micro-batch's bf16 gradients into its fp32
            # accumulators; it clears the bf16 ones only from a backward hook on the engine's forward
            # output, which the train step's loss (derived from it) does not reach. Left in place they
            # would be added again after every later micro-batch (micro-batch i counted GAS - i times).
            self.ds.optimizer.clear_lp_grads()
        if is_boundary and self._sequence_parallel_params:
            from megatron.core import parallel_state as ps

            reduce_sequence_parallel_grads(self._sequence_parallel_params, ps.get_tensor_model_parallel_group(),
                                           self.ds.optimizer)

    def step(self, skip: bool = False) -> OptimizerOutcome:
        """Optimiser step at the accumulation boundary, skipped (on every rank alike) if ``skip``
        or if the global gradient norm is not finite."""
        self.ds.set_gradient_accumulation_boundary(True)
        norm = self.grad_norm_before_step() if self._own_grad_norm else None
        self._clip_norm = norm  # ZeRO-0's clipping (DeepSpeed calls it inside ds.step()) reuses it
        if norm is not None and not math.isfinite(norm):
            skip = True
        self.skipper.skip_next, self.skipper.stepped = skip, False
        try:
            self.ds.step()
        finally:
            self.skipper.skip_next = False
        if norm is None:
            reported = self.ds.get_global_grad_norm()
            norm = None if reported is None else float(reported)
        if self.zero_stage == 3:
            self._clear_zero3_grad_partitions()
        applied = self.skipper.stepped and not skip  # not stepped: DeepSpeed found a non-finite norm
        return OptimizerOutcome(applied=applied, grad_norm=norm)

    def _clear_zero3_grad_partitions(self) -> None:
        """ZeRO-3 keeps each parameter's fp32 gradient partition in one flat buffer that a step's first
        reduction overwrites (later micro-batches add to it) and hands every partition to AdamW. A parameter
        the step did not reach (the fusion in a 1-pass step) was never overwritten: AdamW stepped it with the
        gradient of the last step that reached it, and the norm and clipping counted that gradient again
        (a 2-pass step's fusion gradient of norm 37 carried through three 1-pass steps). Cleared after each
        step, an unreached parameter has the zero gradient ZeRO-0/1/2 give it."""
        flat = getattr(self.ds.optimizer, "grad_partitions_flat_buffer", None)
        if flat is not None:
            flat.zero_()
        elif not getattr(self.ds.optimizer, "offload_optimizer", False):
            raise RuntimeError("DeepSpeed's ZeRO-3 optimizer has no grad_partitions_flat_buffer: the stale-"
                               "gradient clearing (Engine._clear_zero3_grad_partitions) needs re-checking")

    def grad_norm_before_step(self) -> float:
        """ZeRO-0: the global L2 norm of the (already DP-averaged) gradients, every parameter counted
        once over TP and PP (see :func:`model_parallel_grad_norm`)."""
        return model_parallel_grad_norm(p for p in self.model.parameters() if p.grad is not None)

    @staticmethod
    def _mark_pipeline_replicas(model) -> None:
        """The last stage's copy of the embedding tied to the first stage's is a replica: DeepSpeed
        leaves parameters marked ``ds_pipe_replicated`` out of the gradient norm (counted once)."""
        from megatron.core import parallel_state as ps

        if ps.is_pipeline_first_stage(ignore_virtual=True):
            return
        for p in model.parameters():
            if getattr(p, "shared_embedding", False):
                p.ds_pipe_replicated = True

    def _clip_fp32_gradients(self) -> None:
        """ZeRO-0 fp32 clipping (DeepSpeed calls it only there) with every parameter counted once over
        TP and PP: DeepSpeed's ``clip_grad_norm_`` counts TP-replicated parameters only on
        model-parallel rank 0, i.e. on the first pipeline stage, and tied pipeline replicas twice.
        Keeps the norm (DeepSpeed's ``get_global_grad_norm()`` stays None at ZeRO-0)."""
        params = [p for p in self.ds.module.parameters() if p.grad is not None]
        norm = self._clip_norm if self._clip_norm is not None else model_parallel_grad_norm(params)
        coef = min(1.0, self.ds.gradient_clipping() / (norm + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        self._clip_norm = norm

    @staticmethod
    def _register_shared_weights(deepspeed, model) -> None:
        """ZeRO-3 gathers a parameter only around its owning module's forward. Megatron's tied
        output layer reads the embedding weight from another module: register it as external."""
        for module in model.modules():
            if getattr(module, "share_embeddings_and_output_weights", False) and hasattr(module, "output_layer"):
                weight = module.shared_embedding_or_output_weight()
                if weight is not None:
                    deepspeed.zero.register_external_parameter(module.output_layer, weight)

    # ------------------------------------------------------------------ helpers
    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()
