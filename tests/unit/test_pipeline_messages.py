"""Pipeline messages cannot deadlock on NCCL: every schedule's message plan replayed against a model of
stream-ordered blocking point-to-point communication.

The model (NCCL's semantics, written from its documentation, not from the code under test): each rank
runs its p2p calls in issue order on one stream; a call is a batch (``batch_isend_irecv``, one NCCL
group; a lone isend/irecv is a batch of one), and the rank's next batch starts only when every op of
the current one has completed; a send and its receive complete together, only while both are in
their ranks' current batches (a rendezvous: nothing is buffered). A plan deadlocks when some rank has
batches left and no pair of current batches can complete a message."""

import itertools

import pytest

from fbt_megatron.parallel.messages import RECV, SEND, _receives, _sends, message_plan
from fbt_megatron.parallel.schedule import build_schedule, grad_passes_for


def replay(batches_per_rank) -> bool:
    """True if every rank completes its batches under stream-ordered rendezvous p2p."""
    ranks = len(batches_per_rank)
    position = [0] * ranks
    done = [set() for _ in range(ranks)]

    def current(r):
        return batches_per_rank[r][position[r]] if position[r] < len(batches_per_rank[r]) else ()

    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            for i, (kind, peer, msg) in enumerate(current(r)):
                if i in done[r]:
                    continue
                other = current(peer)
                match = (RECV if kind == SEND else SEND, r, msg)
                if match in other:
                    done[r].add(i)
                    done[peer].add(other.index(match))
                    progress = True
            for q in range(ranks):
                if position[q] < len(batches_per_rank[q]) and len(done[q]) == len(current(q)):
                    position[q] += 1
                    done[q] = set()
                    progress = True
    return all(position[r] == len(batches_per_rank[r]) for r in range(ranks))


def planned_batches(schedule):
    return [[list(items) for _, items in message_plan(schedule, s)] for s in range(schedule.stages)]


def unbatched_post_ahead(schedule, ahead=2):
    """The issue order the runner used before: each receive posted on its own, ``ahead`` per sender
    before use, each send on its own right after its op (a batch of one per call)."""
    stages, grad = schedule.stages, schedule.grad_passes
    per_rank = []
    for s in range(stages):
        incoming: dict = {}
        for src in range(stages):
            for op in schedule.ops[src]:
                for msg, dst in _sends(stages, schedule.passes, grad, src, op):
                    if dst == s:
                        incoming.setdefault(src, []).append(msg)
        posted = {src: 0 for src in incoming}
        calls = []

        def post(src, upto):
            while posted[src] < min(upto, len(incoming[src])):
                calls.append([(RECV, src, incoming[src][posted[src]])])
                posted[src] += 1

        for src in incoming:
            post(src, ahead)
        for op in schedule.ops[s]:
            for msg, src in _receives(stages, grad, s, op):
                post(src, incoming[src].index(msg) + 1 + ahead)
            for msg, dst in _sends(stages, schedule.passes, grad, s, op):
                calls.append([(SEND, dst, msg)])
        per_rank.append(calls)
    return per_rank


def all_cases():
    for stages, m, k, mode, training in itertools.product((2, 3, 4, 8), range(1, 17), (1, 2, 3), ("all", "last"),
                                                          (True, False)):
        if training or mode == "all":  # evaluation has no backward: both modes are the same schedule
            yield stages, m, k, grad_passes_for(k, mode, training)


def test_the_model_sees_a_deadlock():
    """The replay can fail: two ranks that each send first, one message per batch, deadlock; and the
    runner's former unbatched, post-ahead order deadlocks on a 2-stage schedule."""
    assert not replay([[[(SEND, 1, "a")], [(RECV, 1, "b")]], [[(SEND, 0, "b")], [(RECV, 0, "a")]]])
    assert replay([[[(SEND, 1, "a"), (RECV, 1, "b")]], [[(SEND, 0, "b"), (RECV, 0, "a")]]])
    assert not replay(unbatched_post_ahead(build_schedule(2, 4, 2, (0, 1))))


@pytest.mark.slow  # replays every schedule (~8 s)
def test_every_schedule_replays_without_deadlock():
    failures = []
    for stages, m, k, grad in all_cases():
        schedule = build_schedule(stages, m, k, grad)
        if not replay(planned_batches(schedule)):
            failures.append((stages, m, k, grad))
    assert not failures, f"deadlocks: {failures[:5]} ({len(failures)} in all)"


@pytest.mark.parametrize("stages,m,k,grad", [(2, 4, 2, (0, 1)), (3, 5, 3, (2,)), (4, 7, 2, ()), (8, 13, 3, (0, 1, 2))])
def test_plan_sends_after_and_receives_before(stages, m, k, grad):
    """Each message is sent once, by a batch after the op that produces it, and received once, by a
    batch before the op that needs it."""
    schedule = build_schedule(stages, m, k, grad)
    sent, received = {}, {}
    for s in range(stages):
        for slot, items in message_plan(schedule, s):
            for kind, peer, msg in items:
                book = sent if kind == SEND else received
                assert (msg, s) not in book
                book[(msg, s)] = slot
    produced = {(msg, s): i + 1 for s in range(stages) for i, op in enumerate(schedule.ops[s])
                for msg, _ in _sends(stages, k, grad, s, op)}
    needed = {(msg, s): i for s in range(stages) for i, op in enumerate(schedule.ops[s])
              for msg, _ in _receives(stages, grad, s, op)}
    assert sent == produced  # issued right after its op (slot i + 1 is "before op i + 1")
    assert set(received) == set(needed)
    assert all(received[key] <= needed[key] for key in needed)


class _Done:
    def wait(self):
        return True


def _drive(schedule, stage, monkeypatch):
    """Run ``stage``'s ops through a Channel whose batches complete at once (a fake torch.distributed):
    returns the channel and, per op, whether each tensor sent by an earlier op is still alive."""
    import weakref

    import torch

    from fbt_megatron.parallel import messages

    monkeypatch.setattr(messages.dist, "P2POp", lambda *args: args)
    monkeypatch.setattr(messages.dist, "batch_isend_irecv", lambda ops: [_Done() for _ in ops])
    channel = messages.Channel(schedule, stage, list(range(schedule.stages)), None, (4, 2), torch.float32, "cpu")
    sent, alive_at_op = [], []
    for i, op in enumerate(schedule.ops[stage]):
        channel.exchange(i)  # (no reference cycles: a dropped tensor is freed at once)
        alive_at_op.append([ref() is not None for ref in sent])
        for msg, _ in _receives(schedule.stages, schedule.grad_passes, stage, op):
            channel.recv(msg)
        for msg, dst in _sends(schedule.stages, schedule.passes, schedule.grad_passes, stage, op):
            out = torch.randn(4, 2)
            channel.send(msg, dst, out)
            sent.append(weakref.ref(channel.outbox[msg]))
            del out
    channel.finish()
    alive_at_op.append([ref() is not None for ref in sent])  # the last op's sends too, once the step ends
    return channel, alive_at_op


# the most message tensors any stage of the schedule holds at once, for every m in 4..16 (measured)
@pytest.mark.parametrize("stages,k,grad,most_held", [(2, 1, (0,), 2), (3, 3, (0, 1, 2), 5), (4, 2, (1,), 3)])
def test_sent_tensors_are_freed_when_their_batch_completes(stages, k, grad, most_held, monkeypatch):
    """No stage keeps what it sent past the batch right after the op that made it (nothing is held to the
    end of the step), and the tensors a stage holds for messages (``Channel.peak_held``) stay within the
    schedule's width, not the number of micro-batches."""
    peaks = {}
    for m in (4, 8, 12, 16):
        schedule = build_schedule(stages, m, k, grad)
        for s in range(stages):
            channel, alive_at_op = _drive(schedule, s, monkeypatch)
            assert not any(any(alive) for alive in alive_at_op), (m, s, alive_at_op)
            peaks[(m, s)] = channel.peak_held
    # held = sent but not yet in a batch + received but not yet taken: a few tensors whatever m (a stage
    # sends m messages or more per pass), and never more than the schedule's width P*k + 1
    assert max(peaks.values()) == most_held <= stages * k + 1, peaks
