"""The one place where a checkpoint's training state is assembled from, and handed back to, its owners.

Besides the tensors (:mod:`.shards`), ``state.json`` holds what the objects of a run own, each through
its ``state_dict()`` / ``load_state_dict()``:

    train_state      the trainer's counters (step, consumed sequences, skipped steps, pass counts, ...)
    optimizer_steps  = train_state.optimizer_steps (kept at the top level for readers)
    layout           the parallel layout the checkpoint was saved with
    pass_schedule    {"position": the step, **the pass schedule's settings}
    data_cursor      {"consumed_sequences": from train_state, "loader": the data loader's own state}
    recipe           the recipe the run trained with
    callbacks        {key: state} of callbacks that have state (absent when none has); the key is the
                     callback's ``state_key`` attribute, else its class name; two callbacks with one key
                     are refused (their states would overwrite each other)

The layout and the recipe are facts of the run, not owned state. ``fbt ckpt inspect`` and the HF export
read these keys; the format is unchanged from the hand-assembled one it replaces.
"""

from __future__ import annotations


def callback_key(cb) -> str:
    """The key of a callback's state in ``state.json``: its ``state_key``, else its class name."""
    return getattr(cb, "state_key", None) or type(cb).__name__


class CheckpointState:
    def __init__(self, *, train_state, pass_schedule, recipe, layout: dict, loader=None, callbacks=()):
        self.train_state, self.pass_schedule, self.loader = train_state, pass_schedule, loader
        self.recipe, self.layout = recipe, layout
        self.callbacks: list = []
        self._saved_callbacks: dict = {}
        self.add_callbacks(callbacks)

    def add_callbacks(self, callbacks) -> None:
        """Callbacks are state owners too when they have a ``state_dict`` (none of the shipped ones has);
        one added after :meth:`load_state_dict` gets its saved state then. Keys (:func:`callback_key`) must
        be unique: a second callback with one key raises ``ValueError`` naming it."""
        for cb in callbacks:
            if hasattr(cb, "state_dict"):
                key = callback_key(cb)
                if any(callback_key(other) == key for other in self.callbacks):
                    raise ValueError(
                        f"two callbacks with state have the key {key!r} (class {type(cb).__qualname__}): their "
                        "states would overwrite each other in the checkpoint; give each instance its own "
                        "`state_key` attribute")
                self.callbacks.append(cb)
                state = self._saved_callbacks.get(key)
                if state is not None:
                    cb.load_state_dict(state)

    def state_dict(self) -> dict:
        ts = self.train_state.state_dict()
        out = {"train_state": ts, "optimizer_steps": ts["optimizer_steps"], "layout": self.layout,
               "pass_schedule": {"position": ts["step"], **self.pass_schedule.state_dict()},
               "data_cursor": {"consumed_sequences": ts["consumed_sequences"],
                               "loader": self.loader.state_dict() if self.loader is not None else None},
               "recipe": self.recipe.model_dump(mode="json")}
        if self.callbacks:
            out["callbacks"] = {callback_key(cb): cb.state_dict() for cb in self.callbacks}
        return out

    def load_state_dict(self, saved: dict) -> None:
        self.train_state.load_state_dict(saved["train_state"])
        self.pass_schedule.load_state_dict(saved.get("pass_schedule", {}))
        counts = self.train_state.pass_counts
        if not self.pass_schedule.feedback and set(counts) - {"1"}:  # saved before a model without a fusion
            # counted its steps as one pass: each of them ran one pass (the model ignores the pass count)
            self.train_state.pass_counts = {"1": sum(counts.values())}
        if self.loader is not None:
            self.loader.load_state_dict(saved.get("data_cursor", {}).get("loader"))
        self._saved_callbacks = dict(saved.get("callbacks", {}))
        callbacks, self.callbacks = self.callbacks, []
        self.add_callbacks(callbacks)
