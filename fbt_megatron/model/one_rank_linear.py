"""Megatron's tensor-parallel linear layers over a one-rank tensor-parallel group, on CPU, as a plain product.

Over one TP rank, ``ColumnParallelLinear`` and ``RowParallelLinear`` compute ``x @ W^T``: nothing is
split and nothing is communicated. Megatron still runs them through its general machinery, each a Python
autograd node forward and backward: ``LinearWithGradAccumulationAndAsyncCommunication`` (asynchronous
all-reduce of the input gradient, gradient accumulation into ``main_grad``, sequence-parallel gathers)
and the region mappings around it (``copy_to_tensor_model_parallel_region``: identity forward, all-reduce
backward; ``reduce_from_tensor_model_parallel_region``: all-reduce forward), each of which is the
identity over one rank. At the 1.8M size of ``benchmarks/bench_train.py`` that is ~70 such nodes a
step, and taking torch's product and the tensor itself instead made the step ~1-2 %
faster (alternating in one process).

:func:`install` puts :func:`linear_with_grad_accumulation_and_async_allreduce` and the two mappings where
Megatron's layers look them up (``megatron.core.tensor_parallel.layers``); the model calls it when it is
built, on the CPU path only (``fbt_gpt.install_cpu_replacements``). They take the short way only for CPU tensors over a one-rank group without gradient accumulation
fusion, sequence parallelism or deferred embedding gradients; everything else (GPU tensors, TP > 1) is
Megatron's own function, as are frozen weights (Megatron's ``linear_with_frozen_weight``, not replaced).
The short way is Megatron's own product, ``torch.matmul(input, weight.t())`` then the bias, under torch's
autograd: values and gradients are bitwise Megatron's (``tests/test_model_one_rank_linear.py``). It is not
``F.linear``: building a ZeRO-3 engine replaces ``torch.nn.functional.linear`` for the whole process with
DeepSpeed's own autograd function.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import layers as megatron_layers

MEGATRON_LINEAR = megatron_layers.linear_with_grad_accumulation_and_async_allreduce
MEGATRON_COPY_TO = megatron_layers.copy_to_tensor_model_parallel_region
MEGATRON_REDUCE_FROM = megatron_layers.reduce_from_tensor_model_parallel_region


def one_rank(group) -> bool:
    """Whether the TP group (``None``: Megatron's default TP group) has one rank."""
    if group is not None:
        return group.size() == 1
    return ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                      wgrad_deferral_limit=0, async_grad_allreduce=None,
                                                      tp_group=None):
    """Megatron's function (same arguments and results); over one CPU rank ``input @ weight^T (+ bias)``."""
    if (input.device.type == "cpu" and not gradient_accumulation_fusion and not allreduce_dgrad
            and not sequence_parallel and grad_output_buffer is None and async_grad_allreduce is None
            and one_rank(tp_group)):
        output = torch.matmul(input, weight.t())
        return output if bias is None else output + bias  # Megatron's order: the product, then the bias
    return MEGATRON_LINEAR(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                           grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)


# Megatron's function reads and sets its one-time warning flag through its module's global name, which
# after install() is this function: carry the flag here.
linear_with_grad_accumulation_and_async_allreduce.warned = MEGATRON_LINEAR.warned


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Megatron's mapping; over one CPU rank the tensor itself (its backward all-reduce is the identity)."""
    if input_.device.type == "cpu" and one_rank(group):
        return input_
    return MEGATRON_COPY_TO(input_, group=group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """Megatron's mapping; over one CPU rank the tensor itself (an all-reduce over one rank)."""
    if input_.device.type == "cpu" and one_rank(group):
        return input_
    return MEGATRON_REDUCE_FROM(input_, group=group)


def install() -> None:
    """Make Megatron's linear layers use the functions above (idempotent)."""
    megatron_layers.linear_with_grad_accumulation_and_async_allreduce = linear_with_grad_accumulation_and_async_allreduce
    megatron_layers.copy_to_tensor_model_parallel_region = copy_to_tensor_model_parallel_region
    megatron_layers.reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region
