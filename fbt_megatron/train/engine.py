"""DeepSpeed ZeRO (data parallelism + optimiser) over a Megatron-Core tensor-parallel model.

DeepSpeed is told about Megatron's parallel groups through :class:`MegatronMPU`, so ZeRO partitions
over the data-parallel group only, and the gradient norm counts TP-sharded parameters once per TP
rank and TP-replicated parameters once. On CPU DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over the
gloo process group that :mod:`fbt_megatron.runtime` already started; params and optimiser are fp32.
On GPU (or with FBT_DTYPE=bf16) the model is bf16 with fp32 master weights (DeepSpeed's bf16 mode).

The optimiser is ``torch.optim.AdamW`` (``"torch_adam": true``); its ``step`` is wrapped so a step
that the train step flags as non-finite is skipped without touching weights or moments, for every
ZeRO stage. The learning rate is set on the optimiser before each step from a pure function of the
step (:mod:`lr_schedule`), so the schedule needs no state of its own.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fbt_megatron import runtime
from fbt_megatron.train.optim_step import chunked_adamw_step


def ensure_ds_accelerator() -> None:
    """DS_ACCELERATOR must be chosen before ``import deepspeed``."""
    if not runtime.use_cuda():
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("DS_BUILD_OPS", "0")


def import_deepspeed():
    ensure_ds_accelerator()
    import deepspeed

    if not runtime.use_cuda():
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (used only for inference
        # all-reduce) at comm init: a C++ toolchain and a minute on a fresh machine. Not needed here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(
                f"deepspeed was imported with accelerator {name!r} before DS_ACCELERATOR=cpu was set; "
                "import fbt_megatron.train.engine (or set DS_ACCELERATOR=cpu) before deepspeed")
    return deepspeed


class MegatronMPU:
    """Megatron-Core ``parallel_state`` under the method names DeepSpeed's ``mpu`` expects."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.ps = ps

    # model parallel = tensor x pipeline
    def get_model_parallel_group(self):
        return self.ps.get_model_parallel_group()

    def get_model_parallel_rank(self):
        return dist.get_rank(self.ps.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.ps.get_model_parallel_group())

    # tensor parallel
    def get_tensor_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self):
        return self.ps.get_tensor_model_parallel_src_rank()

    # data parallel
    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group_ranks(self):
        return dist.get_process_group_ranks(self.ps.get_data_parallel_group())

    # pipeline
    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self):
        return self.ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return self.ps.get_pipeline_model_parallel_world_size()

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size

    # slice parallel (DeepSpeed's name for the model-parallel slice)
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size


def deepspeed_config(recipe, dp_size: int) -> dict:
    b, o = recipe.batch, recipe.optimizer
    cfg = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": recipe.accumulation_steps(dp_size),
        "train_batch_size": b.global_batch_size,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                       "torch_adam": True, "adam_w_mode": True},
        },
        "zero_optimization": {"stage": recipe.parallel.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if runtime.default_dtype_name() == "bf16":
        cfg["bf16"] = {"enabled": True}
    if recipe.parallel.zero_stage in (1, 2) and not runtime.use_cuda():
        # On CPU a contiguous gradient buffer only adds a copy of every gradient per micro-batch
        # (profiled: ~15% of a ZeRO-2 step at 28M parameters); there is no fragmentation to avoid.
        cfg["zero_optimization"]["contiguous_gradients"] = False
    if recipe.parallel.zero_stage == 3:
        # Small, deterministic buckets; no prefetch reordering surprises on CPU.
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return cfg


class SkippableStep:
    """Wraps the inner optimiser's ``step`` so the train step can skip one step entirely."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.skip_next = False
        self._step = optimizer.step
        if type(optimizer) is torch.optim.AdamW:  # the same update, chunk by chunk (optim_step.py)
            self._step = lambda *a, **k: chunked_adamw_step(optimizer)

        def step(*args, **kwargs):
            if self.skip_next:
                return None
            return self._step(*args, **kwargs)

        optimizer.step = step


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
        params = [p for p in model.parameters() if p.requires_grad]
        if self.sequence_parallel:
            self._hook_sequence_parallel_grads(params)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=params, config=self.config, mpu=MegatronMPU(),
            dist_init_required=False)
        self.model = self.ds.module
        if self.zero_stage == 3:
            self._register_shared_weights(deepspeed, self.model)
        self.torch_optimizer = _inner_optimizer(self.ds.optimizer)
        self.skipper = SkippableStep(self.torch_optimizer)
        self._materialize_optimizer_state()
        self._clip_norm = None
        if hasattr(self.ds, "clip_fp32_gradients"):
            self.ds.clip_fp32_gradients = self._clip_fp32_gradients

    def _clip_fp32_gradients(self) -> None:
        """ZeRO-0 fp32: DeepSpeed clips with its model-parallel-aware ``clip_grad_norm_`` but drops the
        norm (``get_global_grad_norm()`` stays None); keep it so every stage reports its grad norm."""
        from deepspeed.runtime.utils import clip_grad_norm_

        self._clip_norm = float(clip_grad_norm_(parameters=self.ds.module.parameters(),
                                                max_norm=self.ds.gradient_clipping(), mpu=self.ds.mpu))

    def _materialize_optimizer_state(self) -> None:
        """Create AdamW's state (step 0, zero moments) now instead of lazily at the first step.

        torch's AdamW initialises exactly these values on its first step, so training is unchanged;
        having them early lets a resume write loaded moments into them (and ZeRO 1/2 link each
        parameter's fragment of the flat state, which the checkpoint's fragment access uses).
        """
        opt = self.torch_optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        # ZeRO-3 hands its flat fp32 partitions to the inner optimiser only during step(): find them here
        # so a resume can load moments before the first step.
        params += [p for p in getattr(self.ds.optimizer, "fp32_partitioned_groups_flat", None) or [] if p is not None]
        for p in params:
            if not opt.state.get(p):
                opt.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        link = getattr(self.ds.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None and self.zero_stage in (1, 2):
            link()
        elif link is not None and hasattr(self.ds.optimizer, "_hp_optimizer_states_linked"):
            link()  # bf16 optimizer (ZeRO-0 on GPU)

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
            group["lr"] = lr

    def backward(self, loss: torch.Tensor, is_boundary: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(is_boundary)
        # The train step already normalised the loss over the whole global batch.
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, skip: bool = False) -> float | None:
        """Optimiser step at the accumulation boundary; returns the global grad norm (None if skipped)."""
        self.skipper.skip_next = skip
        self._clip_norm = None
        try:
            self.ds.set_gradient_accumulation_boundary(True)
            self.ds.step()
        finally:
            self.skipper.skip_next = False
        if skip:
            return None
        norm = self.ds.get_global_grad_norm()
        norm = self._clip_norm if norm is None else norm
        return None if norm is None else float(norm)

    @staticmethod
    def _register_shared_weights(deepspeed, model) -> None:
        """ZeRO-3 gathers a parameter only around its owning module's forward. Megatron's tied
        output layer reads the embedding weight from another module: register it as external."""
        for module in model.modules():
            if getattr(module, "share_embeddings_and_output_weights", False) and hasattr(module, "output_layer"):
                weight = module.shared_embedding_or_output_weight()
                if weight is not None:
                    deepspeed.zero.register_external_parameter(module.output_layer, weight)

    @staticmethod
    def _hook_sequence_parallel_grads(params) -> None:
        """With sequence parallelism, params marked ``sequence_parallel`` (norms and biases that see
        only this rank's sequence chunk) get partial grads: sum them over the TP group as each grad is
        produced, before DeepSpeed accumulates or reduce-scatters it over DP (works for ZeRO 0-3)."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()

        def allreduce(grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        for p in params:
            if getattr(p, "sequence_parallel", False):
                p.register_hook(allreduce)

    # ------------------------------------------------------------------ helpers
    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()
