"""Layer-0 probes: train a tiny FBT and a standard model on a synthetic task, collect the input of
every layer (and of layer 0 with and without one feedback step, plus the controls) and fit linear
probes for the task's hidden variables.

Runs in a world of one (call inside ``runtime.init_distributed()`` + ``init_parallel_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fbt_megatron.config import FeedbackConfig, ModelConfig, PassScheduleConfig
from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.research.fixed_point import stack_inputs
from fbt_megatron.passes import PassSchedule
from fbt_megatron.research.tasks import TASKS, TaskBatch


@dataclass
class ToySetup:
    task: str
    seq_len: int = 64
    batch: int = 32
    steps: int = 600
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    lr: float = 3e-3
    # Passes from step 0 (a short run has no room for a long single-pass phase); 3-pass batches
    # are kept so the map is trained to contract.
    mix: tuple[float, ...] = (0.5, 0.3, 0.2)
    task_kwargs: dict | None = None


def _tensors(b: TaskBatch) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.from_numpy(b.input_ids), "labels": torch.from_numpy(b.labels),
            "loss_mask": torch.from_numpy(b.loss_mask)}


def make_batch(setup: ToySetup, rng: np.random.Generator, batch: int | None = None) -> TaskBatch:
    return TASKS[setup.task](rng, batch or setup.batch, setup.seq_len, **(setup.task_kwargs or {}))


def build_toy_model(setup: ToySetup, fusion: str, seed: int, vocab_size: int):
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=setup.num_layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                      vocab_size=vocab_size, max_sequence_length=setup.seq_len)
    return build_model(cfg, FeedbackConfig(fusion=fusion))


def train_toy_model(setup: ToySetup, fusion: str, seed: int, steps: int | None = None):
    """A model trained on the task: FBT (fusion='glu') with the pass mix, or standard ('off')."""
    rng = np.random.default_rng(seed)
    vocab = make_batch(setup, np.random.default_rng(0), batch=1).vocab_size
    model = build_toy_model(setup, fusion, seed, vocab)
    schedule = PassSchedule.of(PassScheduleConfig(feedback_start_step=0, mix=list(setup.mix), seed=seed),
                               model.feedback_config)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(setup.steps if steps is None else steps):
        t = _tensors(make_batch(setup, rng))
        k = schedule.num_passes(step)
        out = model(t["input_ids"], labels=t["labels"], num_passes=k, jitter_seed=seed * 100_003 + step)
        loss = (out.token_loss * t["loss_mask"]).sum() / t["loss_mask"].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return model, losses


@torch.no_grad()
def layer_inputs(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Features [B, S, D] at the stack's layers. Standard model: the input of every layer and the top.
    FBT model: layer 0's input in pass 1 (no feedback), after one feedback step (pass 2), at the exact
    recurrence (S passes), and the controls with the fed-back state zeroed or shuffled across the batch."""
    batch, seq = input_ids.shape
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.gpt.decoder.layers):
        def pre(mod, args, kwargs, i=i):
            captured[i] = (kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).detach()
        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        feats: dict[str, torch.Tensor] = {}
        bsd = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731  [S, B, D] -> [B, S, D]
        if model.feedback is None:
            out = model(input_ids, num_passes=1)
            for i in sorted(captured):
                feats[f"layer{i}"] = bsd(captured[i])
            feats["top"] = bsd(out.hidden)
            return feats
        fb = model.feedback
        emb, mask, rotary, reset = stack_inputs(model, input_ids)
        gate = fb.token_gate(emb)
        x1 = fb.pass_input(None, emb, gate, reset)  # pass 1: the token embeddings
        top1 = model.run_stack(x1, mask, rotary)
        state = fb.shift_states(top1, reset)
        feats["layer0_pass1"] = bsd(x1)
        feats["layer0_feedback1"] = bsd(fb.stack_input(state, emb, gate, reset))
        feats["layer0_feedback1_zeroed"] = bsd(fb.stack_input(torch.zeros_like(state), emb, gate, reset))
        perm = torch.roll(torch.arange(batch), 1)  # every row gets another row's states
        feats["layer0_feedback1_shuffled"] = bsd(fb.stack_input(state[:, perm], emb, gate, reset))
        model(input_ids, num_passes=seq)  # exact recurrence: the last pass's layer-0 input
        feats["layer0_exact"] = bsd(captured[0])
        return feats
    finally:
        for h in hooks:
            h.remove()


def fit_probe(features: np.ndarray, labels: np.ndarray, train_rows: np.ndarray, test_rows: np.ndarray,
              seed: int = 0) -> float:
    """Held-out accuracy of a linear (multinomial logistic) probe; features [B, S, D], labels [B, S]
    with -1 where undefined; rows split into train and test sequences."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def flat(rows):
        x, y = features[rows].reshape(-1, features.shape[-1]), labels[rows].reshape(-1)
        keep = y >= 0
        return x[keep], y[keep]

    xtr, ytr = flat(train_rows)
    xte, yte = flat(test_rows)
    if len(np.unique(ytr)) < 2:
        return float(np.mean(yte == ytr[0]))
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500, random_state=seed))
    probe.fit(xtr, ytr)
    return float(probe.score(xte, yte))


def majority_baseline(labels: np.ndarray, train_rows: np.ndarray, test_rows: np.ndarray) -> float:
    ytr, yte = labels[train_rows].reshape(-1), labels[test_rows].reshape(-1)
    ytr, yte = ytr[ytr >= 0], yte[yte >= 0]
    values, counts = np.unique(ytr, return_counts=True)
    return float(np.mean(yte == values[np.argmax(counts)]))
