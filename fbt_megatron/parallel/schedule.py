"""The order of a multi-pass pipeline step: which op each stage runs when (no communication, no torch).

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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

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
