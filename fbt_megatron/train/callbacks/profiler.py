"""torch.profiler over a window of steps; a Chrome trace per rank."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from fbt_megatron.train.callbacks.base import Callback


class Profiler(Callback):
    """torch.profiler over ``num_steps`` steps from ``start_step``; a Chrome trace per rank."""

    priority = 30

    def __init__(self, out_dir: Path, start_step: int, num_steps: int):
        self.out_dir, self.start, self.stop_at = Path(out_dir), start_step, start_step + num_steps
        self.prof = None

    def on_step_end(self, trainer, r) -> None:
        import torch.profiler as tp

        s = trainer.state.step
        if s == self.start and self.prof is None:
            acts = [tp.ProfilerActivity.CPU]
            if __import__("torch").cuda.is_available():
                acts.append(tp.ProfilerActivity.CUDA)
            self.prof = tp.profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
        elif s == self.stop_at and self.prof is not None:
            self._finish()

    def _finish(self) -> None:
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.prof.export_chrome_trace(str(self.out_dir / f"trace_rank{rank}.json"))
        self.prof = None

    def on_train_end(self, trainer) -> None:
        if self.prof is not None:
            self._finish()
