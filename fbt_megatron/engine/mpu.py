"""Megatron-Core's parallel groups under the names DeepSpeed's ``mpu`` argument expects."""

from __future__ import annotations

import torch.distributed as dist


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
