"""Text in, text out: the Python API behind ``fbt generate`` and the lm-eval adapter.

    from fbt_megatron.generate.api import TextGenerator
    gen = TextGenerator.from_checkpoint("runs/tiny")            # run dir or step_N dir
    out = gen.generate(["def "], SamplingParams(max_new_tokens=40, stop=["\\n\\n"]))
    print(out[0].text)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fbt_megatron.errors import UserError
from fbt_megatron.generate.decoder import FeedbackDecoder
from fbt_megatron.generate.loading import LoadedModel, load_for_inference
from fbt_megatron.generate.sampling import SamplingParams


@dataclass
class Completion:
    prompt: str
    text: str  # generated text, cut before the first stop string
    tokens: list[int]
    finish_reason: str  # "length", "eos" or "stop"


TRUNCATE = ("none", "left")


class PromptTooLong(UserError, ValueError):
    """A prompt that does not fit the model's context with the tokens asked for (and no truncation)."""


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class TextGenerator:
    def __init__(self, loaded: LoadedModel, mode: str = "feedback", prefill_passes=2):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.decoder = FeedbackDecoder(loaded.model, mode, prefill_passes)

    @classmethod
    def from_checkpoint(cls, path, *, tokenizer: str | None = None, mode: str = "feedback",
                        prefill_passes=2) -> TextGenerator:
        return cls(load_for_inference(path, tokenizer=tokenizer), mode, prefill_passes)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    def encode(self, text: str) -> list[int]:
        """A prompt is one document; an empty one starts after an end-of-document token."""
        return list(self.tokenizer.encode(text)) or [self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def context_length(self) -> int:
        return self.loaded.model.model_config.max_sequence_length

    def fit_prompts(self, encoded: list[list[int]], max_new_tokens: int, truncate: str = "none") -> list[list[int]]:
        """The prompts' token ids as decoded: each with the last ``max_new_tokens - 1`` generated tokens
        must fit the model's context. ``truncate="left"`` keeps a longer prompt's last tokens; ``"none"``
        refuses it with :class:`PromptTooLong` (before anything is generated), naming the prompt."""
        if truncate not in TRUNCATE:
            raise ValueError(f"truncate={truncate!r} is not one of {TRUNCATE}")
        limit = self.context_length
        room = limit - (max_new_tokens - 1)  # the last sampled token is returned, never fed
        if room < 1:
            raise PromptTooLong(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                                f"context of {limit} tokens (max_sequence_length); use at most {limit}")
        if truncate == "left":
            return [list(e[-room:]) for e in encoded]
        for i, e in enumerate(encoded, 1):
            if len(e) > room:
                raise PromptTooLong(f"prompt {i} has {len(e)} tokens, but the model's context of {limit} tokens "
                                    f"leaves room for {room} with --max-new-tokens {max_new_tokens}; shorten it, "
                                    f"lower --max-new-tokens, or use --truncate left to keep its last {room} tokens")
        return [list(e) for e in encoded]

    def generate(self, prompts: Sequence[str], params: SamplingParams | None = None, *,
                 padding: str = "left", stream: Callable[[int, str], None] | None = None,
                 max_prompt_tokens: int | None = None, prompt_ids: list[list[int]] | None = None,
                 truncate: str | None = None) -> list[Completion]:
        """Complete each prompt. ``stream(b, text_delta)`` receives text as it is generated;
        ``max_prompt_tokens`` keeps only a prompt's last tokens (lm-eval's truncation); ``prompt_ids``:
        the prompts already tokenized (chat templates, generate/chat.py); ``truncate``: see
        :meth:`fit_prompts` (None: no check here, the decoder refuses what does not fit)."""
        params = params or SamplingParams()
        encoded = [list(e) for e in prompt_ids] if prompt_ids is not None else [self.encode(p) for p in prompts]
        if max_prompt_tokens is not None:
            encoded = [e[-max_prompt_tokens:] for e in encoded]
        if truncate is not None:
            encoded = self.fit_prompts(encoded, params.max_new_tokens, truncate)
        shown = [""] * len(prompts)

        def text_of(b, ids):
            return cut_at_stop(self.decode(ids), params.stop)

        def is_stopped(b, ids):
            return bool(params.stop) and text_of(b, ids)[1]

        on_token = None
        if stream is not None:
            generated: list[list[int]] = [[] for _ in prompts]

            def on_token(b, tok):  # streams the text that is final so far
                generated[b].append(tok)
                text, _ = text_of(b, generated[b])
                if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its bytes
                    return
                # hold back a tail that could still become a stop string
                hold = max((len(s) - 1 for s in params.stop), default=0)
                safe = text if hold == 0 else text[: max(len(shown[b]), len(text) - hold)]
                if len(safe) > len(shown[b]) and safe.startswith(shown[b]):
                    stream(b, safe[len(shown[b]):])
                    shown[b] = safe

        out = self.decoder.generate(encoded, params, padding=padding, eos_id=self.eos_id,
                                    vocab_limit=self.tokenizer.get_piece_size(), is_stopped=is_stopped,
                                    on_token=on_token)
        completions = []
        for b, prompt in enumerate(prompts):
            text, _ = text_of(b, out.tokens[b])
            if stream is not None and text.startswith(shown[b]) and len(text) > len(shown[b]):
                stream(b, text[len(shown[b]):])
            completions.append(Completion(prompt, text, out.tokens[b], out.finish_reasons[b]))
        return completions
