"""A tiny trained-looking run for generation/eval tests: a sentencepiece tokenizer and a checkpoint
written by the real CheckpointManager (random weights, zero optimiser moments), in the current TP
layout."""

from pathlib import Path
import torch

from fbt_megatron.config import FeedbackConfig, ModelConfig

TEXT = ["def add(a, b):\n    return a + b\n", "The answer is 42.\n", "x = 1 + 2\nprint(x)\n",
        "Question: what is 3 plus 4?\nAnswer: 7\n", "for i in range(10):\n    total += i\n"] * 40
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=320, max_sequence_length=96)


def make_tokenizer(directory: Path) -> Path:
    from data_pipeline.tokenizer import train_tokenizer

    path = Path(directory) / "tok.model"
    if not path.exists():
        train_tokenizer(TEXT, path, vocab_size=300, num_threads=1, seed_sentencepiece_size=10_000)
    return path


def save_run(run_dir: Path, tokenizer: Path, seed: int = 0, value_std: float = 0.3) -> Path:
    """Build the tiny model (seeded) in the current layout and save it as ``run_dir``'s checkpoint
    through the training engine and the checkpoint manager (as a training run saves it)."""
    import torch.distributed as dist

    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.generate.model import build_inference_model
    from fbt_megatron.engine import Engine
    from fbt_megatron.recipe import load_recipe

    torch.manual_seed(seed)
    train_recipe = load_recipe(data={"model": MODEL, "data": {"synthetic": {"vocab_size": 256}},
                                     "parallel": {"tensor": dist.get_world_size(), "zero_stage": 0},
                                     "batch": {"micro_batch_size": 1, "global_batch_size": 1}})
    model = build_inference_model(ModelConfig(**MODEL), FeedbackConfig())
    with torch.no_grad():  # make the fed-back state matter
        model.feedback.value.weight.normal_(0.0, value_std)
    specs = param_specs(model)
    zero = StateFragments(Engine(model, train_recipe), specs)
    recipe = {"name": "gen-test", "model": MODEL, "feedback": FeedbackConfig().model_dump(),
              "data": {"source": "pipeline", "pipeline": {"tokenizer": str(tokenizer)}}}
    state = {"train_state": {"step": 1}, "optimizer_steps": 0, "recipe": recipe,
             "layout": {"tensor": dist.get_world_size()}}
    return CheckpointManager(Path(run_dir) / "checkpoints").save(1, zero, state)
