"""``fbt generate --chat``: prompts rendered by the run's chat template.

An SFT checkpoint carries its chat template next to ``tokenizer.model`` (``chat_template.jinja``,
train/sft.py). A user prompt (and an optional system prompt) becomes ``[system], user`` messages,
rendered with ``add_generation_prompt`` by the same transformers ``apply_chat_template`` call on the
same converted tokenizer that an HF export's tokenizer makes, so both give the same token ids
(tests/integration/test_sft.py checks it). The assistant's end-of-turn token is EOS, where decoding stops.
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.chat import TEMPLATE_FILE


def find_chat_template(checkpoint: str | Path) -> str:
    """The chat template a checkpoint carries; a clear error when it has none (not an SFT run)."""
    from fbt_megatron.checkpoint.manager import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    path = ckpt / TEMPLATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} carries no chat template ({TEMPLATE_FILE}): --chat needs a checkpoint of "
                                f"`fbt sft` (or of a run on `fbt data prepare --format chat` data)")
    return path.read_text()


def chat_prompt_ids(sp, template: str, prompts: list[str], system: str | None = None) -> list[list[int]]:
    """Token ids of each user prompt as a chat turn awaiting the assistant's answer. ``sp``: the run's
    tokenizer (``load_tokenizer``'s: sentencepiece or Hugging Face)."""
    from data_pipeline.chat import chat_messages, chat_tokenizer, prompt_ids

    tok = chat_tokenizer(sp, template)
    return [prompt_ids(tok, chat_messages(p, system)) for p in prompts]


def chat_prompt_texts(sp, template: str, prompts: list[str], system: str | None = None) -> list[str]:
    """The text of each rendered chat prompt (what :func:`chat_prompt_ids` encodes): what the model sees."""
    from data_pipeline.chat import chat_messages, chat_tokenizer

    tok = chat_tokenizer(sp, template)
    return [tok.apply_chat_template(chat_messages(p, system), tokenize=False, add_generation_prompt=True)
            for p in prompts]


def export_chat_template(checkpoint: str | Path, out: Path) -> bool:
    """HF export: the checkpoint's chat template into ``tokenizer_config.json`` (``chat_template``, read by
    transformers 4.x and 5.x) and ``chat_template.jinja``; False when the checkpoint has none."""
    import json

    from fbt_megatron.checkpoint.manager import resolve_checkpoint

    src = resolve_checkpoint(checkpoint) / TEMPLATE_FILE
    cfg_file = Path(out) / "tokenizer_config.json"
    if not src.is_file() or not cfg_file.is_file():
        return False
    template = src.read_text()
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = template
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (Path(out) / TEMPLATE_FILE).write_text(template)
    return True
