"""Pipeline parallelism for multi-pass teacher forcing: the k passes of a step on a ring of stages.

A k-pass micro-batch visits the stages k times. Pass j's top states leave the last stage and travel
the ring back to the first stage (``next = (r+1) % P``, as in Megatron's interleaved schedule), where
they become pass j+1's input by the model's one rule (``LatentFeedback.pass_input``: shifted, mixed,
fused with the token embeddings; the embedding at document starts). Pass j of a
micro-batch is therefore virtual chunk j of an interleaved schedule whose chunks share one set of
weights; gradients travel the same ring backwards (first stage -> last stage carries the gradient of
pass j's top states from pass j+1's backward).

The order of ops is :mod:`.schedule`; the messages between stages are :mod:`.messages`; this module
runs this rank's ops of a step.

Tied embeddings across the first and last stage: both stages hold a copy of the word-embedding
weight (Megatron's embedding group). During the step both use a *detached* copy, so their
contributions collect outside the optimiser; after the schedule the two contributions are summed over
the embedding group and each copy receives that sum in ONE final backward (the accumulation
boundary): exactly one gradient accumulation and one optimiser update per step for the shared weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fbt_megatron.parallel.messages import Channel
from fbt_megatron.parallel.micro_batches import RunnerOutput, to_device
from fbt_megatron.parallel.schedule import FORWARD, Op, build_schedule, grad_passes_for
from fbt_megatron.parallel.timing import StepClock


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


def rows_as_one(batch: dict) -> dict:
    """A micro-batch's B rows end to end as one row, each row start a document start: packed attention
    under sequence parallelism (``FBTGPTModel._rows_as_one``, the whole model's form of the same)."""
    from fbt_megatron.model.fbt_gpt import reset_positions

    rows, seq = batch["input_ids"].shape
    out = {k: (v.reshape(1, -1) if torch.is_tensor(v) and v.shape[:2] == (rows, seq) else v) for k, v in batch.items()}
    starts = reset_positions(batch.get("doc_start"), rows, seq, batch["input_ids"].device).t()
    out["doc_start"] = starts.reshape(1, -1)
    return out


def _default_backward(tensors, grads) -> None:
    torch.autograd.backward(tensors, grads)


# ---------------------------------------------------------------------- backward through the engine
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


class StepGradients:
    """A pipeline step's parameter gradients summed outside DeepSpeed (in fp32) and handed to it in ONE
    ``engine.backward`` at the accumulation boundary (:meth:`finish`). ZeRO-2 reduces a gradient every
    time its hook fires, i.e. in every backward call: through the engine, each of a step's m·k stage-pass
    backward ops would reduce every gradient of the stage again. The stage's gradients are held whole
    for the step instead (as ZeRO-1 holds them; Megatron's distributed optimizer does the same).

    :meth:`backward` is a ``backward(tensors, grads, leaves)`` for :meth:`PipelineRunner.run`: the
    gradients of the parameters go into the sums, those of ``leaves`` (the non-parameter tensors whose
    ``.grad`` the runner reads: received activations, the embedding leaves, the tied-weight copy) are
    accumulated into their ``.grad`` as torch's backward would."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.sums: list = [None] * len(self.params)

    def backward(self, tensors, grads, leaves=()) -> None:
        leaves = [t for t in leaves if t is not None and t.requires_grad and t.is_leaf]
        got = torch.autograd.grad(tensors, self.params + leaves, grads, allow_unused=True)
        for i, g in enumerate(got[:len(self.params)]):
            if g is not None:
                self.sums[i] = g.float() if self.sums[i] is None else self.sums[i].add_(g)
        for leaf, g in zip(leaves, got[len(self.params):]):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g

    def finish(self, engine) -> None:
        """The step's one ``engine.backward``: the surrogate sum(p * g) has gradient g for each p (cast to
        p's dtype once), so DeepSpeed's hooks see each gradient once and reduce it once."""
        terms = [(p * g).sum() for p, g in zip(self.params, self.sums) if g is not None]
        surrogate = sum(terms) if terms else (self.params[0] * 0.0).sum()
        self.sums = [None] * len(self.params)
        engine.backward(surrogate, is_boundary=True)


class PipelineRunner:
    """Runs this rank's share of a multi-pass step on its model stage (an :class:`FBTGPTModel`
    built under Megatron's pipeline parallel state). With ``engine`` (an :class:`~fbt_megatron.engine.Engine`
    wrapping ``model``) a training step's gradients go through DeepSpeed (:func:`engine_backward`,
    then the accumulation boundary :func:`finish_backward`); without, through torch autograd."""

    def __init__(self, model, engine=None):
        from megatron.core import parallel_state as ps

        self.model, self.engine = model, engine
        self.stages = ps.get_pipeline_model_parallel_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.stage_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.first = self.stage == 0
        self.last = self.stage == self.stages - 1
        gpt = model.gpt
        self.tied = gpt.share_embeddings_and_output_weights and self.stages > 1 and (self.first or self.last)
        self.embedding_group = ps.get_embedding_group() if self.tied else None
        # Sequence parallelism: the stages exchange each TP rank's own [S/TP, B, D] chunk (no TP
        # scatter/gather: the chunks differ); the first stage gathers the fed-back state to the whole
        # sequence for the fusion, as the whole model does.
        self.sequence_parallel = model.config.sequence_parallel
        # A collective on the stage group before its first batch_isend_irecv: on NCCL, a batch that is
        # the group's first collective must include every rank of the group (torch's documentation),
        # and the first round of a schedule involves only the first two stages.
        dist.all_reduce(torch.zeros(1, device=next(model.parameters()).device), group=self.pp_group)

    def shared_weight(self) -> torch.Tensor | None:
        """This stage's copy of the weight tied across the first and last stage (or None)."""
        return self.model.gpt.shared_embedding_or_output_weight() if self.tied else None

    # ------------------------------------------------------------------ the step
    def run(self, micro_batches: list[dict], num_passes: int, *, training: bool, scale: float = 1.0,
            jitter_seeds: list | None = None, backward=None, timings: bool = False, device=None) -> RunnerOutput:
        """Forward (and backward if ``training`` and grad is enabled) of every micro-batch with
        ``num_passes`` passes. Backward ops call ``backward(tensors, grads)``; the tied weight's
        summed gradient is delivered by a last ``backward([weight], [grad])`` on its stages (skipped
        when there is none; default: through the engine if the runner has one, else torch autograd).
        Returns the loss sum and pass residuals, identical on every stage."""
        micro_batches = [to_device(b, device) for b in micro_batches]  # the schedule holds them all
        rows = None
        if self.sequence_parallel and self.model.packed and micro_batches:  # packed under SP: rows as one row
            rows = micro_batches[0]["input_ids"].shape[0]
            micro_batches = [rows_as_one(b) for b in micro_batches]
        if self.model.feedback is not None:
            self.model.feedback.rows_as_one = rows  # the jitter drawn as for the rows (the whole model's way)

        through_engine = backward is None and self.engine is not None
        collected = None  # ZeRO-2: the step's gradients reach DeepSpeed in one backward (StepGradients)
        if through_engine and training and torch.is_grad_enabled() and self.engine.zero_stage == 2:
            collected = StepGradients(self.model.parameters())
            backward = collected.backward
        elif backward is None:
            backward = engine_backward(self.engine) if through_engine else _default_backward
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
        clock = StepClock(device) if timings else None
        tp = model.config.tensor_model_parallel_size
        chunk = seq_len // tp if self.sequence_parallel else seq_len
        channel = Channel(schedule, self.stage, self.stage_ranks, self.pp_group,
                          (chunk, batch, model.config.hidden_size), dtype, device, clock=clock,
                          tp_group=None if self.sequence_parallel else self.tp_group)
        self._tied_leaf = None
        if self.tied and training:
            self._tied_leaf = self.shared_weight().detach().requires_grad_()
        self._ctx = dict(k=k, grad_passes=grad_passes, training=training, scale=scale, channel=channel,
                         backward=backward, collected=collected, grad_mode=cfg.grad_mode,
                         loss_on=cfg.loss_on if training else "last")  # the mean over passes is a training loss
        self._mbs = [_MicroBatch(b) for b in micro_batches]
        self._saved: dict = {}
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._residuals = torch.zeros(max(k - 1, 0), dtype=torch.float64, device=device)
        self._residual_max = torch.full((), -1.0, dtype=torch.float64, device=device)
        marks = []
        for i, op in enumerate(schedule.ops[self.stage]):
            start, waits = (clock.mark(), len(channel.waits)) if timings else (None, 0)
            channel.exchange(i)  # the messages planned before this op (sends of the previous one)
            if op.kind == FORWARD:
                self._forward(op, jitter_seeds[op.micro_batch] if jitter_seeds else None)
            else:
                self._backward(op)
            if timings:
                marks.append((op, start, clock.mark(), waits, len(channel.waits)))
        channel.finish()
        seconds = []
        if timings:  # (op, start, end, seconds of it spent waiting for a message)
            clock.resolve()
            seconds = [(op, clock.at(start), clock.at(end), sum(clock.between(a, b) for a, b in channel.waits[w0:w1]))
                       for op, start, end, w0, w1 in marks]
        if self._saved:
            raise RuntimeError(f"pipeline step left {len(self._saved)} activations without a backward")
        if self._tied_leaf is not None:  # the shared weight: one accumulation, summed over both stages
            grad = self._tied_leaf.grad if self._tied_leaf.grad is not None else torch.zeros_like(self._tied_leaf)
            dist.all_reduce(grad, group=self.embedding_group)
            self._call_backward([self.shared_weight()], [grad], [])
        sums = torch.cat([self._loss_sum.view(1), self._residuals])
        dist.all_reduce(sums, group=self.pp_group)  # lives on the last stage: give it to every stage
        dist.all_reduce(self._residual_max, op=dist.ReduceOp.MAX, group=self.pp_group)
        self._mbs, self._saved = [], {}
        if self.model.feedback is not None:
            self.model.feedback.rows_as_one = None
        if collected is not None:
            collected.finish(self.engine)
        elif through_engine and training:
            finish_backward(self.engine, self.model)
        return RunnerOutput(sums[0], list(sums[1:]), self._residual_max if k > 1 else None, seconds)

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
                    top = None
                    if j > 0:
                        ring_in = ctx["channel"].recv(("ring", self.stages - 1, b, j - 1))
                        if grad and j - 1 in ctx["grad_passes"]:
                            ring_in.requires_grad_()
                        top = model._full_sequence(ring_in)  # SP: this rank's chunk -> the whole sequence
                    gate = mb.gate if owner else mb.gate_leaf
                    x = model.feedback.pass_input(top, embedded, gate, mb.reset, mb.generator)
            else:
                x = ctx["channel"].recv(("act", self.stage - 1, b, j))
                if grad:
                    x.requires_grad_()
            out = model.run_stack(x, *self._attention(mb))
            loss = None
            if self.last:
                loss = self._head(mb, out, j, grad)
        if self.last:
            with torch.no_grad():
                full = model._full_sequence(out.detach()) if k > 1 else None  # SP: residuals of the whole
            if j > 0:
                with torch.no_grad():
                    prev = mb.previous_top
                    r = ((full - prev).norm() / prev.norm().clamp_min(1e-12)).double()
                    self._residuals[j - 1] += r
                    if j == k - 1:
                        self._residual_max = torch.maximum(self._residual_max, r)
            mb.previous_top = full if j < k - 1 else None
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
        per document), computed once per step on every stage from the batch's ``doc_start`` and the
        loader's ``cu_seqlens``."""
        from fbt_megatron.model.fbt_gpt import reset_positions

        if mb.attention is None:
            data = mb.data
            batch, seq_len = data["input_ids"].shape
            mb.reset = reset_positions(data.get("doc_start"), batch, seq_len, data["input_ids"].device)
            mask, positions = self.model.attention_inputs(  # as the whole model: from doc_start
                mb.reset, cu_seqlens=data.get("cu_seqlens"), max_seqlen=data.get("max_seqlen"))
            mb.attention = (mask, self.model.rotary(positions), positions)
        return mb.attention[:2]

    def _start_micro_batch(self, mb: _MicroBatch, jitter_seed) -> None:
        model, ctx, data = self.model, self._ctx, mb.data
        ids = data["input_ids"]
        self._attention(mb)
        with torch.set_grad_enabled(bool(ctx["grad_passes"])):
            mb.embedded = model.embed(ids, mb.attention[2], word_weight=self._tied_leaf)
            if model.feedback is not None and model.feedback.needs_token_gate(ctx["k"]):
                mb.gate = model.feedback.token_gate(model._full_sequence(mb.embedded))
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

    def _call_backward(self, tensors, grads, leaves) -> None:
        """The step's backward function; :class:`StepGradients` also gets the tensors whose ``.grad``
        the runner reads (torch's own backward fills them by itself)."""
        if self._ctx["collected"] is not None:
            self._ctx["collected"].backward(tensors, grads, leaves)
        else:
            self._ctx["backward"](tensors, grads)

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
        # the tensors whose .grad is read after this op (sent, or accumulated over passes)
        leaves = [x if not self.first else None, ring_in, mb.embedded_leaf, mb.gate_leaf, self._tied_leaf]
        self._call_backward(tensors, grads, leaves)
        if not self.first:
            ctx["channel"].send(("grad", self.stage, b, j), self.stage - 1, x.grad)
        elif j - 1 in ctx["grad_passes"]:
            ctx["channel"].send(("ringgrad", self.stage, b, j), self.stages - 1, ring_in.grad)
        if final:
            self._mbs[b] = _MicroBatch({})  # this micro-batch is done on this stage
