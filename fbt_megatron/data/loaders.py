"""A recipe's training and validation batches for one data-parallel rank.

``data.source: pipeline`` reads tokenized shards through the data pipeline (``data_pipeline/``; the
embedded mix is built offline on first use); ``data.source: synthetic`` uses :mod:`.synthetic`. Both
give the same global batch for every DP size.
"""

from __future__ import annotations

import torch.distributed as dist

from fbt_megatron.recipe import Recipe, RecipeError

VALID_OFFSET = 1 << 40  # the synthetic validation stream lives far from the training stream


def build_train_loader(recipe: Recipe, dp_rank: int, dp_size: int, consumed_sequences: int,
                       saved_cursor: dict | None = None, *, data_config=None):
    """This rank's training batches from the global cursor. ``saved_cursor`` is the loader state a
    checkpoint recorded: the data pipeline resumes from it and refuses a changed seed, mix, tokenizer or
    split (a silently different data stream would make the resumed run a different experiment).
    ``data_config``: the run plan's ``DataConfig`` (default: the recipe's ``data.pipeline``)."""
    d = recipe.data
    kw = dict(micro_batch_size=recipe.batch.micro_batch_size, global_batch_size=recipe.global_batch_size,
              dp_rank=dp_rank, dp_size=dp_size, consumed_sequences=consumed_sequences)
    if d.source == "synthetic":
        from fbt_megatron.data.synthetic import SyntheticLoader

        return SyntheticLoader(_synthetic_cfg(recipe), **kw)
    return _data_pipeline_loader(recipe, data_config, split="train", state=saved_cursor, **kw)


class TrainBatches:
    """This rank's training batches as the run's data-loader state owner: ``load_state_dict`` takes the
    loader state a checkpoint saved (None: none), :meth:`start` builds the loader at the trainer's
    cursor (the data pipeline resumes from the saved state, see :func:`build_train_loader`)."""

    def __init__(self, recipe: Recipe, dp_rank: int, dp_size: int, *, data_config=None):
        self.recipe, self.dp_rank, self.dp_size, self.data_config = recipe, dp_rank, dp_size, data_config
        self._saved: dict | None = None
        self.loader = None

    def load_state_dict(self, state: dict | None) -> None:
        self._saved = state

    def start(self, consumed_sequences: int) -> "TrainBatches":
        self.loader = build_train_loader(self.recipe, self.dp_rank, self.dp_size, consumed_sequences, self._saved,
                                         data_config=self.data_config)
        return self

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def __iter__(self):
        return iter(self.loader)


def build_valid_batches(recipe: Recipe, dp_rank: int, dp_size: int, *, data_config=None) -> list[dict]:
    """This rank's share of a fixed validation set (same set for every DP size)."""
    d, mbs = recipe.data, recipe.batch.micro_batch_size
    n = max(dp_size, d.valid_sequences - d.valid_sequences % dp_size)
    if n % (mbs * dp_size):
        mbs = 1
    kw = dict(micro_batch_size=mbs, global_batch_size=n, dp_rank=dp_rank, dp_size=dp_size,
              consumed_sequences=0)
    if d.source == "synthetic":
        from fbt_megatron.data.synthetic import SyntheticLoader

        loader = SyntheticLoader(_synthetic_cfg(recipe), offset=VALID_OFFSET, **kw)
    else:
        loader = _data_pipeline_loader(recipe, data_config, split="valid", **kw)
    it = iter(loader)
    return [next(it) for _ in range(n // (mbs * dp_size))]


def held_out_sets(recipe: Recipe, *, data_config=None, max_rows: int | None = None) -> list[tuple[str, float, list[dict]]]:
    """The held-out documents of each source, read once in one fixed order whatever ``data.seed``:
    ``[(source, its share of the mix's tokens, its batches)]``, the shares renormalised over the sources
    that hold out at least one row. A source's batches are its held-out token stream (data seed 0's order) cut
    into rows from its start; the stream's last partial row and the rows that do not fill a whole
    micro-batch are left out. Synthetic data: the recipe's validation set drawn with data seed 0, one
    "source" of share 1. ``max_rows``: at most that many rows a source (a smoke test's read-out).

    A study's read-outs measure every model on these same tokens: a seed's validation sample
    (:func:`build_valid_batches`) varies with ``data.seed``, and on a mix of a few long documents two
    samples differ in a model pair's loss gap by as much as the effects a study measures."""
    seq = recipe.data.seq_length
    if recipe.data.source == "synthetic":
        fixed = recipe.model_copy(update={"data": recipe.data.model_copy(update={"seed": 0})})
        return [("synthetic", 1.0, build_valid_batches(fixed, 0, 1))]
    from data_pipeline.loader import build_loader, held_out_documents, planner_for
    from data_pipeline.shards import Dataset

    cfg = (data_config or data_pipeline_config(recipe)).model_copy(update={"seed": 0})
    out = []
    for source, weight in zip(cfg.sources, cfg.weights):
        one = cfg.model_copy(update={"sources": [source.model_copy(update={"weight": 1.0})]})
        datasets = [Dataset.load(source.path, allow_skip_corrupt=cfg.allow_skip_corrupt)]
        if held_out_documents(one, datasets) == [0]:
            continue
        order = planner_for(one, "valid", datasets=datasets).orders[0]
        positions = order.ds.tokens_between(order.lo, order.lo + order.n) + order.n  # tokens and EOS
        rows = (positions - 1) // seq  # a row reads seq + 1 positions; rows overlap by one
        if max_rows is not None:
            rows = min(rows, max_rows)
        micro = min(recipe.batch.micro_batch_size, rows)
        if micro == 0:
            continue
        rows -= rows % micro
        # the mix's weights share out the training stream: by documents, a source's tokens are its weight
        # times the training split's mean document length
        share = weight if cfg.weight_by == "tokens" else \
            weight * planner_for(one, "train", datasets=datasets).orders[0].mean_length()
        loader = build_loader(one, split="valid", micro_batch_size=micro, global_batch_size=rows, dp_rank=0,
                              dp_size=1, consumed_sequences=0)
        it = iter(loader)
        out.append((source.name, share, [next(it) for _ in range(rows // micro)]))
    if not out:
        raise RecipeError("the data pipeline's sources hold out no row of documents to validate on "
                          "(data.pipeline.valid_documents)")
    total = sum(share for _, share, _ in out)
    return [(name, share / total, batches) for name, share, batches in out]


def _synthetic_cfg(recipe: Recipe):
    update = {"seq_length": recipe.data.seq_length}
    if recipe.data.seed is not None:
        update["seed"] = recipe.data.seed
    return recipe.data.synthetic.model_copy(update=update)


def prepare_data(data_plan, log):
    """The run plan's ``DataConfig`` (None for synthetic data), after building the embedded token mix if
    the plan names it (offline, idempotent): rank 0 builds, the others wait."""
    if data_plan.config is None:
        return None
    from data_pipeline.config import DataConfig

    if data_plan.build_embedded is not None:
        from data_pipeline.embedded import build_embedded

        if dist.get_rank() == 0:
            build_embedded(data_plan.build_embedded, seq_length=data_plan.config["seq_length"], progress=False,
                           log=lambda m: log(f"[data] {m}"))
        dist.barrier()
    return DataConfig.model_validate(data_plan.config)


def data_pipeline_config(recipe: Recipe):
    """The recipe's ``data.pipeline`` section as the data pipeline's ``DataConfig``."""
    from data_pipeline.config import DataConfig

    cfg = dict(recipe.data.pipeline or {})
    cfg["seq_length"] = recipe.data.seq_length
    if recipe.data.seed is not None:
        cfg["seed"] = recipe.data.seed
    return DataConfig.model_validate(cfg)


def _data_pipeline_loader(recipe: Recipe, data_config, split: str, **kw):
    from data_pipeline.loader import build_loader

    # split="valid" reads only the held-out documents (data.pipeline.valid_documents per source), which
    # the train split never contains.
    return build_loader(data_config or data_pipeline_config(recipe), split=split, **kw)
