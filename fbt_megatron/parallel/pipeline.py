"""Pipeline parallelism for multi-pass teacher forcing: the k passes of a step on a ring of stages.

A k-pass micro-batch visits the stages k times. Pass j's top states leave the last stage and travel
the ring back to the first stage (``next = (r+1) % P``, as in Megatron's interleaved schedule), where
they become pass j+1's input by the model's one rule (``LatentFeedback.pass_input``: shifted, mixed,
fused with the token embeddings; the embedding at document starts). Pass j of a
micro-batch is therefore virtual chunk j of an interleaved schedule whose chunks share one set of
weights; gradients travel the same ring backwards (first stage -> last stage carries the gradient of
pass j's top states from pass j+1's backward).

Ops and dependencies, per stage s of P, micro-batch b, pass j (``F`` forward, ``B`` backward):
- F(s,b,j) needs F(s-1,b,j); on the first stage F(0,b,j) needs F(P-1,b,j-1) (the ring);
- B(s,b,j) needs B(s+1,b,j); on the last stage B(P-1,b,j) needs F(P-1,b,j) and, when the gradient
  flows through the passes (``grad_mode=all``), B(0,b,j+1) (the ring backwards).
With ``grad_mode=last`` passes 1..k-1 are forward only (no activations kept) and only pass k has B ops.

The order each stage runs its ops in comes from :func:`build_schedule`, which simulates candidate
orders with costs B = 2 F and keeps the fastest (then the one holding the fewest activations):
Megatron's interleaved 1F1B order with pass j as virtual chunk j (micro-batches in groups of P, each
group through every pass; warm-up, one-forward-one-backward, drain), and list-scheduled orders
(backward-first or forward-first, a cap on micro-batches in flight per stage) that cover what the
interleaved order does not (``grad_mode=last``, m not a multiple of P). Every rank builds the same
schedule; its simulation is a witness that running each stage's list in order with blocking receives
cannot deadlock. Bubble for uniform costs, ``grad_mode=all``, m a multiple of P: (P-1) / (m*k + P-1)
of the step (see docs/pipeline.md).

Communication: ``torch.distributed.batch_isend_irecv`` (gloo and NCCL alike), one batch per
*round* of the schedule's simulation (the time the sending op finishes), issued by both ends between
the ops where that time falls and awaited at once (:func:`message_plan`). On NCCL all p2p ops of a
rank run in issue order on one stream and a send waits for its receive, so receives posted ahead as
lone ``irecv`` can deadlock; the round order cannot (the argument is in :func:`message_plan`, and
``tests/test_pipeline_messages.py`` replays every schedule against a model of stream-ordered blocking
p2p). A sent tensor is dropped as soon as its batch completes, right after the op that made it.

Tied embeddings across the first and last stage: both stages hold a copy of the word-embedding
weight (Megatron's embedding group). During the step both use a *detached* copy, so their
contributions collect outside the optimiser; after the schedule the two contributions are summed over
the embedding group and each copy receives that sum in ONE final backward (the accumulation
boundary): exactly one gradient accumulation and one optimiser update per step for the shared weight.
"""

from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

FORWARD, BACKWARD = "F", "B"


class Op(NamedTuple):  # a tuple: hashing it is cheap, and the schedule search hashes it a lot
    kind: str  # "F" or "B"
    micro_batch: int
    pass_index: int


@dataclass
class Schedule:
    stages: int
    micro_batches: int
    passes: int
    grad_passes: tuple[int, ...]  # passes that run a backward (all, or only the last)
    ops: list[list[Op]]  # per stage, in execution order
    start: dict  # (stage, Op) -> simulated start time
    finish: dict  # (stage, Op) -> simulated finish time
    costs: tuple[float, float]  # (forward, backward) cost of one op in the simulation

    @property
    def makespan(self) -> float:
        return max(self.finish.values())

    def busy(self, stage: int) -> float:
        return sum(self.finish[(stage, op)] - self.start[(stage, op)] for op in self.ops[stage])

    def bubble(self, stage: int) -> float:
        """Idle fraction of the step on ``stage`` in the simulation."""
        return 1.0 - self.busy(stage) / self.makespan

    def peak_activations(self, stage: int) -> int:
        """Most stage-pass activations held at once on ``stage`` (forwards awaiting their backward)."""
        held = peak = 0
        for op in self.ops[stage]:
            if op.kind == FORWARD and op.pass_index in self.grad_passes:
                held += 1
                peak = max(peak, held)
            elif op.kind == BACKWARD:
                held -= 1
        return peak

    def timeline(self, stage: int, resolution: float = 1.0) -> str:
        """A one-line text rendering: ``F0.1`` = forward of micro-batch 0, pass 1; ``.`` = idle."""
        cells = []
        t = 0.0
        for op in self.ops[stage]:
            begin, end = self.start[(stage, op)], self.finish[(stage, op)]
            cells += ["  .  "] * int(round((begin - t) / resolution))
            label = f"{op.kind}{op.micro_batch}.{op.pass_index + 1}"
            cells += [f"{label:^5}"] * int(round((end - begin) / resolution))
            t = end
        return "|".join(cells)


def grad_passes_for(passes: int, grad_mode: str, training: bool) -> tuple[int, ...]:
    if not training:
        return ()
    return tuple(range(passes)) if grad_mode == "all" else (passes - 1,)


def _dependencies(stages: int, grad_passes: tuple[int, ...], stage: int, op: Op):
    b, j = op.micro_batch, op.pass_index
    if op.kind == FORWARD:
        if stage > 0:
            yield stage - 1, Op(FORWARD, b, j)
        elif j > 0:
            yield stages - 1, Op(FORWARD, b, j - 1)
    elif stage < stages - 1:
        yield stage + 1, Op(BACKWARD, b, j)
    else:
        yield stage, Op(FORWARD, b, j)
        if j + 1 in grad_passes:
            yield 0, Op(BACKWARD, b, j + 1)


def _all_ops(stages, micro_batches, passes, grad_passes):
    ops = []
    for b in range(micro_batches):
        for j in range(passes):
            ops.append(Op(FORWARD, b, j))
            if j in grad_passes:
                ops.append(Op(BACKWARD, b, j))
    return ops


def _timed(stages, micro_batches, passes, grad_passes, orders, costs, stage_costs=None) -> Schedule | None:
    """Simulated times of running each stage's ``orders`` in order (an op starts when the stage is
    free and its dependencies have finished); None if the orders deadlock. ``stage_costs[s]``
    overrides ``costs`` per stage: (forward, backward), or a function of the op."""
    start, finish = {}, {}
    position, clock = [0] * stages, [0.0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                deps = list(_dependencies(stages, grad_passes, s, op))
                if any(d not in finish for d in deps):
                    break
                start[(s, op)] = t = max([clock[s]] + [finish[d] for d in deps])
                cost = stage_costs[s] if stage_costs else costs
                seconds = cost(op) if callable(cost) else cost[0] if op.kind == FORWARD else cost[1]
                finish[(s, op)] = clock[s] = t + seconds
                position[s] += 1
                progress = True
    if any(position[s] < len(orders[s]) for s in range(stages)):
        return None
    return Schedule(stages, micro_batches, passes, tuple(grad_passes), orders, start, finish, tuple(costs))


def _ring_order(micro_batches, passes, group, reverse=False):
    """Megatron's interleaved order: micro-batches in groups of ``group`` (= P), each group through
    every pass (virtual chunk) before the next group; backward runs the passes in reverse."""
    out = []
    for first in range(0, micro_batches, group):
        for jj in range(passes):
            j = passes - 1 - jj if reverse else jj
            out += [(b, j) for b in range(first, min(first + group, micro_batches))]
    return out


def _interleaved_1f1b(stages, micro_batches, passes, grad_passes):
    """Megatron's interleaved 1F1B with pass j as virtual chunk j: stage s runs a warm-up of
    2(P-s-1) + (k-1)P forwards ((P-s-1) at k=1), then alternates one forward and one backward, then
    drains the backwards. Holds at most warm-up + 1 stage-pass activations per stage."""
    forwards = [Op(FORWARD, b, j) for b, j in _ring_order(micro_batches, passes, stages)]
    backwards = [Op(BACKWARD, b, j) for b, j in _ring_order(micro_batches, passes, stages, reverse=True)
                 if j in grad_passes]
    orders = []
    for s in range(stages):
        warmup = (stages - s - 1) if passes == 1 else 2 * (stages - s - 1) + (passes - 1) * stages
        warmup = min(len(forwards), warmup) if backwards else len(forwards)
        order = forwards[:warmup]
        for i, f in enumerate(forwards[warmup:]):
            order.append(f)
            if i < len(backwards):
                order.append(backwards[i])
        order += backwards[max(0, len(forwards) - warmup):]
        orders.append(order)
    return orders


def _greedy(stages, micro_batches, passes, grad_passes, costs, max_in_flight, backward_first):
    """List scheduling: whenever a stage is free it runs the best-priority ready op — backward
    first (1F1B-like) or forward first (fills bubbles with forwards), then Megatron's ring order —
    starting a new micro-batch only while fewer than ``max_in_flight`` are in flight on the stage.
    Ready ops are tracked incrementally (an op becomes ready when its last dependency finishes), so
    one order costs O(ops x ready ops) instead of re-testing every remaining op at every step."""
    ops = _all_ops(stages, micro_batches, passes, grad_passes)
    rank = {(b, j): i for i, (b, j) in enumerate(_ring_order(micro_batches, passes, stages))}
    done_kind = BACKWARD if grad_passes else FORWARD
    done_pass = min(grad_passes) if grad_passes else passes - 1

    def priority_of(op):
        key = rank[(op.micro_batch, op.pass_index)]
        return ((op.kind == FORWARD) == backward_first, key if op.kind == FORWARD else -key)

    priority = {op: priority_of(op) for op in ops}

    waiting, dependents, ready_at = {}, {}, {}  # (stage, op) -> deps left / who waits on it / deps' finish
    ready = [{} for _ in range(stages)]  # stage -> {op: time its dependencies finished}
    for s in range(stages):
        for op in ops:
            deps = list(_dependencies(stages, grad_passes, s, op))
            waiting[(s, op)] = len(deps)
            for d in deps:
                dependents.setdefault(d, []).append((s, op))
            if not deps:
                ready[s][op] = 0.0
    clock = [0.0] * stages
    in_flight, started = [set() for _ in range(stages)], [set() for _ in range(stages)]
    orders = [[] for _ in range(stages)]
    left = stages * len(ops)
    while left:
        best = None
        for s in range(stages):
            full = len(in_flight[s]) >= max_in_flight
            t0, chosen = None, None
            for op, t in ready[s].items():
                if full and op.micro_batch not in started[s]:
                    continue
                t = max(clock[s], t)
                if t0 is None or t < t0 or (t == t0 and priority[op] < priority[chosen]):
                    t0, chosen = t, op
            if chosen is not None and (best is None or t0 < best[0]):
                best = (t0, s, chosen)
        if best is None:  # all stages wait on a cap: this cap cannot work
            return None
        t0, s, op = best
        finish = clock[s] = t0 + (costs[0] if op.kind == FORWARD else costs[1])
        del ready[s][op]
        left -= 1
        orders[s].append(op)
        for d in dependents.get((s, op), ()):
            waiting[d] -= 1
            ready_at[d] = max(ready_at.get(d, 0.0), finish)
            if not waiting[d]:
                ready[d[0]][d[1]] = ready_at[d]
        if op.micro_batch not in started[s]:
            started[s].add(op.micro_batch)
            in_flight[s].add(op.micro_batch)
        if op.kind == done_kind and op.pass_index == done_pass:
            in_flight[s].discard(op.micro_batch)
    return orders


@functools.lru_cache(maxsize=64)
def build_schedule(stages: int, micro_batches: int, passes: int, grad_passes: tuple[int, ...],
                   costs: tuple[float, float] = (1.0, 2.0)) -> Schedule:
    """The per-stage op order for one step (identical on every rank): Megatron's interleaved 1F1B
    order when it reaches the lower bound; otherwise, of it and list-scheduled orders (backward-first
    and forward-first, in-flight caps 1..2P), the one with the shortest simulated step, then the
    fewest activations held on any stage."""
    if stages < 1 or micro_batches < 1 or passes < 1:
        raise ValueError(f"pipeline schedule needs stages, micro_batches, passes >= 1 "
                         f"(got {stages}, {micro_batches}, {passes})")
    f, b = costs
    # no order beats one ramp-up and one ramp-down around the stage's work
    bound = micro_batches * (passes * f + len(grad_passes) * b) + (stages - 1) * (f + (b if grad_passes else 0))
    interleaved = _timed(stages, micro_batches, passes, grad_passes,
                         _interleaved_1f1b(stages, micro_batches, passes, grad_passes), costs)
    if interleaved is not None and interleaved.makespan <= bound + 1e-9:
        return interleaved
    # list scheduling; caps above 2P micro-batches in flight only cost memory (and search time)
    candidates = [interleaved.ops] if interleaved is not None else []
    for backward_first in (True, False):
        for cap in range(1, min(micro_batches, 2 * stages) + 1):
            candidates.append(_greedy(stages, micro_batches, passes, grad_passes, costs, cap, backward_first))
    best = None
    for orders in candidates:
        schedule = orders and _timed(stages, micro_batches, passes, grad_passes, orders, costs)
        if not schedule:
            continue
        key = (round(schedule.makespan, 9), max(schedule.peak_activations(s) for s in range(stages)))
        if best is None or key < best[0]:
            best = (key, schedule)
    return best[1]


def simulated_bubbles(schedule: Schedule, stage_costs: list) -> list[float]:
    """Per-stage idle fraction of ``schedule``'s order with each stage's own op times and free
    communication: what the schedule achieves for unbalanced stages. ``stage_costs[s]``: (forward,
    backward) seconds, or a function of the op (e.g. the last stage's LM-head passes cost more)."""
    timed = _timed(schedule.stages, schedule.micro_batches, schedule.passes, schedule.grad_passes,
                   schedule.ops, schedule.costs, stage_costs)
    return [timed.bubble(s) for s in range(schedule.stages)]


def theoretical_bubble(stages: int, micro_batches: int, passes: int, grad_mode: str = "all",
                       forward: float = 1.0, backward: float = 2.0) -> float:
    """Idle fraction of a step when the ring is full except one ramp-up and one ramp-down of
    (P-1) forward+backward slots: (P-1)(f+b) / (m (k f + n_b b) + (P-1)(f+b)), n_b = k backward
    passes with grad_mode=all, 1 with last. For f = b/2 and grad_mode=all: (P-1) / (m k + P-1)."""
    ramp = (stages - 1) * (forward + backward)
    backward_passes = passes if grad_mode == "all" else 1
    return ramp / (micro_batches * (passes * forward + backward_passes * backward) + ramp)


# ---------------------------------------------------------------------- messages
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
    of round t need only messages of earlier rounds. (``tests/test_pipeline_messages.py`` replays every
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


class _Channel:
    """Point-to-point messages of one step for this rank, issued as :func:`message_plan` says: before
    op ``i`` the runner calls :meth:`exchange` (``i``), which runs every batch planned before op ``i``
    with ``torch.distributed.batch_isend_irecv`` (Megatron's p2p_communication does the same per
    schedule step) and waits for it. A sent tensor is dropped when its batch completes, right after the
    op that produced it; a received one is held until its op takes it (:meth:`recv`)."""

    def __init__(self, schedule: Schedule, stage: int, stage_ranks: list[int], group, shape, dtype, device):
        self.stage, self.ranks, self.group = stage, stage_ranks, group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.plan = message_plan(schedule, stage)
        self.tags = {msg: i for order in _message_orders(schedule).values() for i, msg in enumerate(order)}
        self.next = 0  # the first batch of the plan not yet issued
        self.outbox: dict = {}  # msg -> tensor the runner sent, awaiting its batch
        self.inbox: dict = {}  # msg -> received tensor, awaiting its op
        self.waited = 0.0  # seconds spent blocked in batches (benchmarks: idle, not work)
        self.peak_held = 0  # most tensors held in the outbox and inbox at once

    def send(self, msg, dst: int, tensor: torch.Tensor) -> None:
        self.outbox[msg] = tensor.detach().contiguous()
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
                    buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, self.ranks[peer], self.group, self.tags[msg]))
                    received.append((msg, buffer))
            t0 = time.perf_counter()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            self.waited += time.perf_counter() - t0
            self.inbox.update(received)
            self.peak_held = max(self.peak_held, len(self.outbox) + len(self.inbox))
            self.next += 1

    def finish(self) -> None:
        self.exchange(float("inf"))
        if self.inbox or self.outbox:
            raise RuntimeError(f"pipeline step ended with {len(self.inbox)} unconsumed and "
                               f"{len(self.outbox)} unsent messages")


# ---------------------------------------------------------------------- execution
@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # sum over micro-batches of (token loss * mask), float64, same on all stages
    residuals: list[torch.Tensor] = field(default_factory=list)  # per pass > 1, summed over micro-batches
    last_residual_max: torch.Tensor | None = None  # the last pass's largest residual over micro-batches
    op_seconds: list = field(default_factory=list)  # (op, start, end, waited) on this rank (benchmarks)


@dataclass
class _MicroBatch:
    data: dict
    # First stage: the embeddings and the token path sigmoid(W_G e), computed once per micro-batch
    # (they do not change between passes; the gate only when some pass reads it). Pass
    # min(grad_passes) uses their graphs, the other grad passes detached leaves whose accumulated
    # gradients go through W_G and the embedding once, in that pass's backward.
    embedded: torch.Tensor | None = None
    embedded_leaf: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    gate_leaf: torch.Tensor | None = None
    reset: torch.Tensor | None = None
    attention: tuple | None = None  # (mask, rotary) of this row's documents, every stage
    generator: torch.Generator | None = None
    previous_top: torch.Tensor | None = None  # last stage: the previous pass's top state (residuals)


def _default_backward(tensors, grads) -> None:
    torch.autograd.backward(tensors, grads)


class PipelineRunner:
    """Runs this rank's share of a multi-pass step on its model stage (an :class:`FBTGPTModel`
    built under Megatron's pipeline parallel state)."""

    def __init__(self, model):
        from megatron.core import parallel_state as ps

        self.model = model
        self.stages = ps.get_pipeline_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.stage_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first = self.stage == 0
        self.last = self.stage == self.stages - 1
        gpt = model.gpt
        self.tied = gpt.share_embeddings_and_output_weights and self.stages > 1 and (self.first or self.last)
        self.embedding_group = ps.get_embedding_group() if self.tied else None
        if model.config.sequence_parallel:
            raise ValueError("parallel.sequence_parallel with parallel.pipeline > 1 is not supported")
        # A collective on the stage group before its first batch_isend_irecv: on NCCL, a batch that is
        # the group's first collective must include every rank of the group (torch's documentation),
        # and the first round of a schedule involves only the first two stages.
        dist.all_reduce(torch.zeros(1, device=next(model.parameters()).device), group=self.pp_group)

    def shared_weight(self) -> torch.Tensor | None:
        """This stage's copy of the weight tied across the first and last stage (or None)."""
        return self.model.gpt.shared_embedding_or_output_weight() if self.tied else None

    # ------------------------------------------------------------------ the step
    def run(self, micro_batches: list[dict], num_passes: int, *, training: bool, scale: float = 1.0,
            jitter_seeds: list | None = None, backward=_default_backward, timings: bool = False) -> StepOutput:
        """Forward (and backward if ``training`` and grad is enabled) of every micro-batch with
        ``num_passes`` passes. Backward ops call ``backward(tensors, grads)``; the tied weight's
        summed gradient is delivered by a last ``backward([weight], [grad])`` on its stages (skipped
        when there is none). Returns the loss sum and pass residuals, identical on every stage."""
        model, cfg = self.model, self.model.feedback_config
        k = num_passes
        if cfg.fusion == "off" and k != 1:
            raise ValueError(f"num_passes={k} needs feedback (feedback.fusion='off' runs one pass)")
        training = training and torch.is_grad_enabled()
        grad_passes = grad_passes_for(k, cfg.grad_mode, training)
        schedule = build_schedule(self.stages, len(micro_batches), k, grad_passes)
        batch, seq_len = micro_batches[0]["input_ids"].shape
        device = micro_batches[0]["input_ids"].device
        dtype = model.config.params_dtype
        channel = _Channel(schedule, self.stage, self.stage_ranks, self.pp_group,
                           (seq_len, batch, model.config.hidden_size), dtype, device)
        self._tied_leaf = None
        if self.tied and training:
            self._tied_leaf = self.shared_weight().detach().requires_grad_()
        self._ctx = dict(k=k, grad_passes=grad_passes, training=training, scale=scale, channel=channel,
                         backward=backward, loss_on=cfg.loss_on, grad_mode=cfg.grad_mode)
        self._mbs = [_MicroBatch(b) for b in micro_batches]
        self._saved: dict = {}
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._residuals = torch.zeros(max(k - 1, 0), dtype=torch.float64, device=device)
        self._residual_max = torch.full((), -1.0, dtype=torch.float64, device=device)
        seconds = []
        for i, op in enumerate(schedule.ops[self.stage]):
            t0, waited = time.perf_counter(), channel.waited
            channel.exchange(i)  # the messages planned before this op (sends of the previous one)
            if op.kind == FORWARD:
                self._forward(op, jitter_seeds[op.micro_batch] if jitter_seeds else None)
            else:
                self._backward(op)
            if timings:  # (op, start, end, seconds of it spent waiting for a message)
                seconds.append((op, t0, time.perf_counter(), channel.waited - waited))
        channel.finish()
        if self._saved:
            raise RuntimeError(f"pipeline step left {len(self._saved)} activations without a backward")
        if self._tied_leaf is not None:  # the shared weight: one accumulation, summed over both stages
            grad = self._tied_leaf.grad if self._tied_leaf.grad is not None else torch.zeros_like(self._tied_leaf)
            dist.all_reduce(grad, group=self.embedding_group)
            backward([self.shared_weight()], [grad])
        sums = torch.cat([self._loss_sum.view(1), self._residuals])
        dist.all_reduce(sums, group=self.pp_group)  # lives on the last stage: give it to every stage
        dist.all_reduce(self._residual_max, op=dist.ReduceOp.MAX, group=self.pp_group)
        self._mbs, self._saved = [], {}
        return StepOutput(sums[0], list(sums[1:]), self._residual_max if k > 1 else None, seconds)

    # ------------------------------------------------------------------ ops
    def _forward(self, op: Op, jitter_seed) -> None:
        model, ctx, mb = self.model, self._ctx, self._mbs[op.micro_batch]
        b, j, k = op.micro_batch, op.pass_index, ctx["k"]
        grad = j in ctx["grad_passes"]
        ring_in = None
        if self.first:
            if j == 0:
                self._start_micro_batch(mb, jitter_seed)
        with torch.set_grad_enabled(grad):
            if self.first:
                owner = not grad or j == min(ctx["grad_passes"])  # reads the graphs, not the leaves
                embedded = mb.embedded if owner else mb.embedded_leaf
                if model.feedback is None:
                    x = embedded
                else:
                    if j > 0:
                        ring_in = ctx["channel"].recv(("ring", self.stages - 1, b, j - 1))
                        if grad and j - 1 in ctx["grad_passes"]:
                            ring_in.requires_grad_()
                    gate = mb.gate if owner else mb.gate_leaf
                    x = model.feedback.pass_input(ring_in, embedded, gate, mb.reset, mb.generator)
            else:
                x = ctx["channel"].recv(("act", self.stage - 1, b, j))
                if grad:
                    x.requires_grad_()
            out = model.run_stack(x, *self._attention(mb))
            loss = None
            if self.last:
                loss = self._head(mb, out, j, grad)
        if self.last:
            if j > 0:
                with torch.no_grad():
                    prev = mb.previous_top
                    r = ((out - prev).norm() / prev.norm().clamp_min(1e-12)).double()
                    self._residuals[j - 1] += r
                    if j == k - 1:
                        self._residual_max = torch.maximum(self._residual_max, r)
            mb.previous_top = out.detach() if j < k - 1 else None
            if j < k - 1:
                ctx["channel"].send(("ring", self.stage, b, j), 0, out)
        else:
            ctx["channel"].send(("act", self.stage, b, j), self.stage + 1, out)
        if grad:
            self._saved[(b, j)] = (x, out, loss, ring_in)
        if j == k - 1 and not ctx["grad_passes"]:
            self._mbs[b] = _MicroBatch({})  # forward only: drop the micro-batch's state now

    def _attention(self, mb: _MicroBatch) -> tuple:
        """(mask, rotary) for a micro-batch's packed documents (document-causal or causal, positions
        per document), computed once per step on every stage from the batch's ``doc_start``."""
        from fbt_megatron.model.fbt_gpt import reset_positions

        if mb.attention is None:
            data = mb.data
            batch, seq_len = data["input_ids"].shape
            mb.reset = reset_positions(data.get("doc_start"), batch, seq_len, data["input_ids"].device)
            mask, positions = self.model.attention_inputs(mb.reset)  # as the whole model: from doc_start
            mb.attention = (mask, self.model.rotary(positions), positions)
        return mb.attention[:2]

    def _start_micro_batch(self, mb: _MicroBatch, jitter_seed) -> None:
        model, ctx, data = self.model, self._ctx, mb.data
        ids = data["input_ids"]
        self._attention(mb)
        with torch.set_grad_enabled(bool(ctx["grad_passes"])):
            mb.embedded = model.embed(ids, mb.attention[2], word_weight=self._tied_leaf)
            if model.feedback is not None and model.feedback.needs_token_gate(ctx["k"]):
                mb.gate = model.feedback.token_gate(mb.embedded)
        if len(ctx["grad_passes"]) > 1:  # one graph per pass: the others read leaves
            mb.embedded_leaf = mb.embedded.detach().requires_grad_()
            if mb.gate is not None:
                mb.gate_leaf = mb.gate.detach().requires_grad_()
        cfg = model.feedback_config
        if model.training and cfg.jitter_std > 0 and jitter_seed is not None:
            mb.generator = torch.Generator(device=ids.device).manual_seed(int(jitter_seed))

    def _head(self, mb: _MicroBatch, out, j: int, grad: bool):
        ctx = self._ctx
        k = ctx["k"]
        if not (j == k - 1 or ctx["loss_on"] == "mean"):
            return None
        heads = k if ctx["loss_on"] == "mean" else 1
        weight = self._tied_leaf if self._tied_leaf is not None else None
        token_loss = self.model.head(out, mb.data["labels"], weight=weight)
        tok_sum = (token_loss.float() * mb.data["loss_mask"]).sum()
        self._loss_sum += tok_sum.detach().double() / heads
        return tok_sum * (ctx["scale"] / heads) if grad else None

    def _backward(self, op: Op) -> None:
        ctx, mb = self._ctx, self._mbs[op.micro_batch]
        b, j = op.micro_batch, op.pass_index
        x, out, loss, ring_in = self._saved.pop((b, j))
        tensors, grads = [], []
        if loss is not None:
            tensors.append(loss)
            grads.append(None)
        if not self.last:
            tensors.append(out)
            grads.append(ctx["channel"].recv(("grad", self.stage + 1, b, j)))
        elif j + 1 in ctx["grad_passes"]:
            tensors.append(out)
            grads.append(ctx["channel"].recv(("ringgrad", 0, b, j + 1)))
        final = j == min(ctx["grad_passes"])
        if self.first and final:  # the other passes' gradients, through W_G and the embedding once
            for graph, leaf in ((mb.gate, mb.gate_leaf), (mb.embedded, mb.embedded_leaf)):
                if leaf is not None and leaf.grad is not None:
                    tensors.append(graph)
                    grads.append(leaf.grad)
        ctx["backward"](tensors, grads)
        if not self.first:
            ctx["channel"].send(("grad", self.stage, b, j), self.stage - 1, x.grad)
        elif j - 1 in ctx["grad_passes"]:
            ctx["channel"].send(("ringgrad", self.stage, b, j), self.stages - 1, ring_in.grad)
        if final:
            self._mbs[b] = _MicroBatch({})  # this micro-batch is done on this stage


def engine_backward(engine):
    """A ``backward(tensors, grads)`` for :meth:`PipelineRunner.run` that goes through DeepSpeed:
    the vector-Jacobian product as the backward of the scalar sum(t * g) (exact: its gradient with
    respect to t is g), so ZeRO's gradient hooks, loss scaling and reductions see an ordinary
    ``engine.backward``. None of these calls is the accumulation boundary; see :func:`finish_backward`."""

    def backward(tensors, grads):
        surrogate = sum(t if g is None else (t * g).sum() for t, g in zip(tensors, grads))
        engine.backward(surrogate, is_boundary=False)

    return backward


def finish_backward(engine, model) -> None:
    """The accumulation boundary on this rank: one more backward, adding exactly zero to one
    parameter's gradient (ZeRO-2 sets up its reduction buckets only when some parameter's gradient
    arrives), so DeepSpeed runs its boundary reductions (ZeRO-0 all-reduce, ZeRO-1 reduce, ZeRO-2
    epilogue) over what the step's backward calls accumulated."""
    param = next(p for p in model.parameters() if p.requires_grad)
    engine.backward((param * 0.0).sum(), is_boundary=True)
