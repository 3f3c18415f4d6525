"""The messages of a pipeline step: what each op sends and receives, and in which batch it travels.

Communication: ``torch.distributed.batch_isend_irecv`` (gloo and NCCL alike), one batch per
*round* of the schedule's simulation (the time the sending op finishes), issued by both ends between
the ops where that time falls and awaited at once (:func:`message_plan`). On NCCL all p2p ops of a
rank run in issue order on one stream and a send waits for its receive, so receives posted ahead as
lone ``irecv`` can deadlock; the round order cannot (the argument is in :func:`message_plan`, and
``tests/unit/test_pipeline_messages.py`` replays every schedule against a model of stream-ordered blocking
p2p). A sent tensor is dropped as soon as its batch completes, right after the op that made it.
Under tensor parallelism each TP rank sends and receives only its 1/TP share of a message and the stage
all-gathers the whole over TP (Megatron's ``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor``):
the TP ranks of a stage hold the same activations and gradients. Under sequence parallelism they hold
different chunks, and each sends its own [S/TP, B, D] chunk instead.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from fbt_megatron.parallel.schedule import FORWARD, Op, Schedule


def _sends(stages: int, passes: int, grad_passes, stage: int, op: Op):
    """(kind, src_stage, micro_batch, pass) messages ``op`` on ``stage`` sends, with their destination."""
    b, j = op.micro_batch, op.pass_index
    if op.kind == FORWARD:
        if stage < stages - 1:
            yield ("act", stage, b, j), stage + 1
        elif j < passes - 1:
            yield ("ring", stage, b, j), 0
    elif stage > 0:
        yield ("grad", stage, b, j), stage - 1
    elif j - 1 in grad_passes:
        yield ("ringgrad", stage, b, j), stages - 1


def _receives(stages: int, grad_passes, stage: int, op: Op):
    """(kind, src_stage, micro_batch, pass) messages ``op`` on ``stage`` needs, with their source."""
    b, j = op.micro_batch, op.pass_index
    if op.kind == FORWARD:
        if stage > 0:
            yield ("act", stage - 1, b, j), stage - 1
        elif j > 0:
            yield ("ring", stages - 1, b, j - 1), stages - 1
    elif stage < stages - 1:
        yield ("grad", stage + 1, b, j), stage + 1
    elif j + 1 in grad_passes:
        yield ("ringgrad", 0, b, j + 1), 0


def _message_orders(schedule: Schedule) -> dict:
    """(src, dst) -> the messages src sends to dst, in send order."""
    orders: dict = {}
    for s in range(schedule.stages):
        for op in schedule.ops[s]:
            for msg, dst in _sends(schedule.stages, schedule.passes, schedule.grad_passes, s, op):
                orders.setdefault((s, dst), []).append(msg)
    return orders


SEND, RECV = "send", "recv"


def message_plan(schedule: Schedule, stage: int) -> list[tuple[int, list]]:
    """How ``stage`` issues its messages: ``[(slot, [(SEND|RECV, peer stage, msg), ...]), ...]``, one
    ``batch_isend_irecv`` per entry, issued (and completed) before the stage's op number ``slot``.

    Every message travels in a *round*: the simulated time its sender's op finishes. Both ends
    put it in their batch of that round, and each stage issues its rounds in time order, placed between
    its ops where the simulated time falls (after the ops that started before it): the sender after
    the op that produced the message, the receiver before the op that needs it (which starts no earlier
    than the message's round). Why this cannot deadlock when every stage runs one stream of blocking
    batches (NCCL: p2p ops in issue order on one stream; a batch completes when all its ops have met
    their peers'): take the earliest round not yet complete on some stage; every stage whose current
    batch is not of that round has completed it already or takes no part in it, and every message of
    that round is in both its ends' current batch, so it completes. The ops before a stage's batch
    of round t need only messages of earlier rounds. (``tests/unit/test_pipeline_messages.py`` replays every
    plan against a model of stream-ordered blocking p2p.)"""
    stages, grad = schedule.stages, schedule.grad_passes
    starts = [schedule.start[(stage, op)] for op in schedule.ops[stage]]  # increasing: ops run in order
    rounds: dict = {}
    for s in range(stages):
        for op in schedule.ops[s]:
            for msg, dst in _sends(stages, schedule.passes, grad, s, op):
                if stage in (s, dst):
                    item = (SEND, dst, msg) if s == stage else (RECV, s, msg)
                    rounds.setdefault(schedule.finish[(s, op)], []).append(item)
    return [(bisect.bisect_left(starts, t), sorted(items)) for t, items in sorted(rounds.items())]


class Channel:
    """Point-to-point messages of one step for this rank, issued as :func:`message_plan` says: before
    op ``i`` the runner calls :meth:`exchange` (``i``), which runs every batch planned before op ``i``
    with ``torch.distributed.batch_isend_irecv`` (Megatron's p2p_communication does the same per
    schedule step) and waits for it. A sent tensor is dropped when its batch completes, right after the
    op that produced it; a received one is held until its op takes it (:meth:`recv`)."""

    def __init__(self, schedule: Schedule, stage: int, stage_ranks: list[int], group, shape, dtype, device,
                 clock=None, tp_group=None):
        self.stage, self.ranks, self.group = stage, stage_ranks, group
        self.shape, self.dtype, self.device = shape, dtype, device
        # Tensor parallelism without sequence parallelism: every TP rank of a stage holds the same
        # activations and gradients, so each sends and receives its 1/TP share and the stage all-gathers
        # the whole over TP (Megatron's scatter/gather of pipeline tensors), TP times less p2p traffic.
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        numel = 1
        for n in shape:
            numel *= n
        if self.tp_group is not None and numel % self.tp_group.size():
            raise ValueError(f"pipeline message of {shape} ({numel} elements) does not split over "
                             f"{self.tp_group.size()} tensor-parallel ranks")
        self.message_numel = numel // (self.tp_group.size() if self.tp_group is not None else 1)
        self.plan = message_plan(schedule, stage)
        self.tags = {msg: i for order in _message_orders(schedule).values() for i, msg in enumerate(order)}
        self.next = 0  # the first batch of the plan not yet issued
        self.outbox: dict = {}  # msg -> tensor the runner sent, awaiting its batch
        self.inbox: dict = {}  # msg -> received tensor, awaiting its op
        self.clock = clock  # a timing.StepClock when the step is timed (benchmarks)
        self.waits: list = []  # (start, end) marks around each batch's wait: idle, not work
        self.peak_held = 0  # most tensors held in the outbox and inbox at once

    def send(self, msg, dst: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        if self.tp_group is not None:  # this TP rank's share (a view; Megatron's split)
            from megatron.core.tensor_parallel.utils import split_tensor_into_1d_equal_chunks

            tensor = split_tensor_into_1d_equal_chunks(tensor, tp_group=self.tp_group)
        self.outbox[msg] = tensor
        self.peak_held = max(self.peak_held, len(self.outbox) + len(self.inbox))

    def recv(self, msg) -> torch.Tensor:
        if msg not in self.inbox:
            raise RuntimeError(f"stage {self.stage} needs {msg}, which its message plan has not received")
        return self.inbox.pop(msg)

    def exchange(self, slot: float) -> None:
        """Run the planned batches that come before op number ``slot``."""
        while self.next < len(self.plan) and self.plan[self.next][0] <= slot:
            ops, received = [], []
            for kind, peer, msg in self.plan[self.next][1]:
                if kind == SEND:
                    if msg not in self.outbox:
                        raise RuntimeError(f"stage {self.stage} must send {msg}, which its ops did not produce")
                    ops.append(dist.P2POp(dist.isend, self.outbox.pop(msg), self.ranks[peer], self.group,
                                          self.tags[msg]))
                else:
                    buffer = torch.empty(self.message_numel if self.tp_group is not None else self.shape,
                                         dtype=self.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, self.ranks[peer], self.group, self.tags[msg]))
                    received.append((msg, buffer))
            start = self.clock.mark() if self.clock else None
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if self.clock:
                self.waits.append((start, self.clock.mark()))
            if self.tp_group is not None:  # the whole from every TP rank's share (Megatron's gather)
                from megatron.core.tensor_parallel.utils import gather_split_1d_tensor

                received = [(msg, gather_split_1d_tensor(b, tp_group=self.tp_group).view(self.shape))
                            for msg, b in received]
            self.inbox.update(received)
            self.peak_held = max(self.peak_held, len(self.outbox) + len(self.inbox))
            self.next += 1

    def finish(self) -> None:
        self.exchange(float("inf"))
        if self.inbox or self.outbox:
            raise RuntimeError(f"pipeline step ended with {len(self.inbox)} unconsumed and "
                               f"{len(self.outbox)} unsent messages")
