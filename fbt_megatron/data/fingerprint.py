"""The run's datasets as a checkpoint records them, and the check a resume makes against them.

Each ``data.pipeline`` source's fingerprint (:func:`data_pipeline.fingerprint.dataset_fingerprint`: tokenizer
hash, document count, content hash of the index) is saved in ``state.json`` under ``data``; a resume on a
changed dataset is refused with one sentence naming the source, unless ``checkpoint.allow_data_change``
(then the change is recorded in the checkpoint and in ``metrics.jsonl``). Why: a dataset re-prepared
under a run silently made the resumed run another experiment.
"""

from __future__ import annotations

from data_pipeline.errors import DataError


class DataChangedError(DataError):
    """A resumed run's dataset differs from the one its checkpoint was trained on."""


def data_fingerprints(data_config) -> dict | None:
    """``{source name: {"path", "tokenizer_hash", "documents", "content"}}`` of the run plan's ``DataConfig``;
    None for synthetic data."""
    if data_config is None:
        return None
    from data_pipeline.fingerprint import dataset_fingerprint

    return {s.name: {"path": str(s.path), **dataset_fingerprint(s.path)} for s in data_config.sources}


def describe_change(name: str, old: dict | None, new: dict | None) -> str | None:
    """What changed in one source (None: nothing)."""
    if old is None or new is None:
        return f"source '{name}' was {'added' if old is None else 'removed'}"
    what = []
    if old["tokenizer_hash"] != new["tokenizer_hash"]:
        what.append(f"tokenizer {old['tokenizer_hash']} -> {new['tokenizer_hash']}")
    if old["documents"] != new["documents"]:
        what.append(f"{old['documents']} -> {new['documents']} documents")
    if not what and old["content"] != new["content"]:
        what.append(f"the same {new['documents']} documents count but other content")
    return f"source '{name}' ({new['path']}): {', '.join(what)}" if what else None


def trained_on_synthetic(state: dict) -> bool:
    """Whether a checkpoint's state.json is of steps trained on synthetic data (an import's step 0 is not:
    it has consumed nothing, so it may go on to any data)."""
    recipe, train_state = state.get("recipe") or {}, state.get("train_state") or {}
    return (recipe.get("data") or {}).get("source") == "synthetic" and int(train_state.get("step", 0)) > 0


def data_changes(saved: dict | None, now: dict | None, *, from_synthetic: bool = False) -> list[str]:
    """One phrase per source whose dataset differs between a checkpoint's record and now (``from_synthetic``:
    the checkpoint trained on synthetic data, so prepared data now is a change of every source)."""
    if from_synthetic and now is not None:
        return ["the checkpoint trained on synthetic data (data.source: synthetic), the recipe reads prepared data"]
    if not saved or now is None:
        return []  # a checkpoint from before the record, or synthetic data
    names = list(dict.fromkeys([*saved, *now]))
    return [c for n in names if (c := describe_change(n, saved.get(n), now.get(n)))]


def check_resume_data(checkpoint: str, saved: dict | None, now: dict | None, allow: bool, *,
                      from_synthetic: bool = False) -> list[str]:
    """The changes (allowed), or :class:`DataChangedError` in one sentence naming the first source."""
    changes = data_changes(saved, now, from_synthetic=from_synthetic)
    if changes and not allow and from_synthetic:
        raise DataChangedError(
            f"checkpoint {checkpoint} trained on synthetic data (data.source: synthetic) and the recipe reads "
            "prepared data: set data.source=synthetic to go on as before, start a new run_dir, or set "
            "checkpoint.allow_data_change=true to continue on the prepared data")
    if changes and not allow:
        more = f" (and {len(changes) - 1} other source(s))" if len(changes) > 1 else ""
        raise DataChangedError(
            f"the data changed since checkpoint {checkpoint}: {changes[0]}{more}, so resuming would train on "
            f"other data; restore the dataset, start a new run_dir, or set checkpoint.allow_data_change=true "
            f"to continue on the new data deliberately")
    return changes
