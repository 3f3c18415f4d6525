"""The FBT model for lm-evaluation-harness, registered as ``fbt``.

    import fbt_megatron.eval.lm_eval_model  # registers --model fbt
    lm_eval.simple_evaluate(model="fbt",
                            model_args="checkpoint=runs/tiny,mode=feedback,prefill_passes=2", tasks=[...])

Model args: ``checkpoint`` (run dir or step dir), ``mode`` (``feedback`` | ``standard``),
``prefill_passes`` (1, 2 = FUSED (default), any K, or ``exact``), ``batch_size``, ``max_length`` (default: the
model's max_sequence_length), ``tokenizer`` (default: the run's), ``padding`` (left | right).

Every request is decoded as generation decodes it: the context is prefilled with K passes, then
the continuation goes through the KV cache token by token with latent feedback, so the
log-likelihoods are those of the model that generates. ``loglikelihood_rolling`` scores a whole text
in disjoint windows of ``max_length`` tokens (lm-eval's rolling windows, EOS as the first context).
Under torchrun every process runs every request with tensor parallelism (lm-eval sees one rank).
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from fbt_megatron.generate.api import TextGenerator
from fbt_megatron.generate.decoder import FeedbackDecoder, parse_prefill_passes
from fbt_megatron.generate.loading import LoadedModel, load_for_inference
from fbt_megatron.generate.sampling import SamplingParams


@register_model("fbt")
class FBTLM(TemplateLM):
    def __init__(self, checkpoint: str | None = None, mode: str = "feedback", prefill_passes="2",
                 batch_size: int | str = 8, max_length: int | None = None, tokenizer: str | None = None,
                 padding: str = "left", seed: int = 0, loaded: LoadedModel | None = None, chat: bool = False,
                 **_ignored):
        super().__init__()
        if loaded is None:
            if not checkpoint:
                raise ValueError("model_args needs checkpoint=RUN_DIR_OR_CHECKPOINT")
            loaded = load_for_inference(checkpoint, tokenizer=tokenizer)
        self.loaded = loaded
        self.text = TextGenerator(loaded, mode, parse_prefill_passes(prefill_passes))
        self.decoder: FeedbackDecoder = self.text.decoder
        self.sp = loaded.tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length or loaded.model_config.max_sequence_length)
        self.padding, self.seed = padding, int(seed)
        self.generated_lengths: list[int] = []  # tokens generated per generate_until request
        # the same, by request index (the request's position in the task: every generation, also repeats and
        # identical prompts, has its own; the same index is the same problem in every mode: eval/lengths.py pairs them)
        self.generated_by_problem: dict[int, int] = {}
        self.prompt_by_problem: dict[int, str] = {}  # the context each request index generated from
        self.chat_tokenizer = None
        if chat:  # lm-eval's apply_chat_template: the checkpoint's template, ids from the same tokenizer
            from data_pipeline.chat import chat_tokenizer
            from fbt_megatron.generate.chat import find_chat_template

            self.chat_tokenizer = chat_tokenizer(self.sp, find_chat_template(loaded.checkpoint))

    # ------------------------------------------------------------------ tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.sp.eos_id()

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        if self.chat_tokenizer is not None:  # a rendered chat holds the end-of-turn token as text ("</s>")
            return list(self.chat_tokenizer(string, add_special_tokens=False)["input_ids"])
        return list(self.sp.encode(string))

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_tokenizer is None:
            raise ValueError("--apply-chat-template: load the model with chat=True (a checkpoint with a chat template)")
        return self.chat_tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return "fbt-sentencepiece" + ("-chat" if self.chat_tokenizer is not None else "")

    def chat_template(self, chat_template=False):
        return self.chat_tokenizer.chat_template if self.chat_tokenizer is not None else None

    def tok_decode(self, ids) -> str:
        return self.sp.decode(list(ids))

    # ------------------------------------------------------------------ scoring
    def _truncate(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The last tokens of context+continuation that fit: the final continuation token is
        predicted, never fed, so max_length + 1 tokens fit; at least one context token stays."""
        whole = (context + continuation)[-(self.max_length + 1):]
        if len(continuation) >= len(whole):
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length={self.max_length}")
        return whole[: len(whole) - len(continuation)], continuation

    def _score_tokens(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool):
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        results: list = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc=desc, disable=disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            chunk = [self._truncate(*pairs[i]) for i in idx]
            scored = self.decoder.score([c for c, _ in chunk], [x for _, x in chunk], padding=self.padding)
            for i, r in zip(idx, scored):
                results[i] = r
            bar.update(len(idx))
        bar.close()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        results = self._score_tokens(pairs, "fbt loglikelihood", disable_tqdm)
        for (key, _, _), r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for w in get_rolling_token_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(n)
        scored = self._score_tokens(windows, "fbt loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, scored):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ------------------------------------------------------------------ generation
    def _sampling(self, kwargs: dict) -> SamplingParams:
        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        if not do_sample:
            temperature = 0.0
        elif temperature == 0.0:
            temperature = 1.0
        return SamplingParams(max_new_tokens=max(1, min(max_new, self.max_length - 1)), temperature=temperature,
                              top_k=int(kwargs.pop("top_k", 0) or 0), top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                              seed=self.seed, stop=until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # batch requests that share generation settings
            groups.setdefault(repr(sorted(req.args[1].items(), key=lambda kv: kv[0])), []).append(i)
        out: list = [None] * len(requests)
        first = len(self.generated_lengths)  # request indices continue over calls
        bar = tqdm(total=len(requests), desc="fbt generate_until", disable=disable_tqdm)
        for members in groups.values():
            params = self._sampling(requests[members[0]].args[1])
            members = sorted(members, key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(members), self.batch_size):
                idx = members[start:start + self.batch_size]
                params.seed = self.seed + start  # reproducible, different draws per batch
                keep = self.max_length + 1 - params.max_new_tokens
                ids = [self.tok_encode(requests[i].args[0])[-keep:] for i in idx] if self.chat_tokenizer else None
                done = self.text.generate([requests[i].args[0] for i in idx], params, padding=self.padding,
                                          max_prompt_tokens=keep, prompt_ids=ids)
                for i, c in zip(idx, done):
                    out[i] = c.text
                    self.generated_lengths.append(len(c.tokens))
                    self.generated_by_problem[first + i] = len(c.tokens)
                    self.prompt_by_problem[first + i] = requests[i].args[0]
                    self.cache_hook.add_partial("generate_until", requests[i].args, c.text)
                bar.update(len(idx))
        bar.close()
        return out
