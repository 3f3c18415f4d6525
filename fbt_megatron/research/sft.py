"""Instruction tuning at small scale (``tools/sft_math.py``): the embedded math problems as
conversations, held-out problems, and the measurement of exact match and generated length per
decoding mode for a base (plain prompt) or an SFT (chat prompt) checkpoint.

The embedded mix's math documents (``data_pipeline.embedded.math_documents``, seed 0) hold 1-4 worked
problems each (``Question: ...\\nAnswer: ... #### N``); every problem becomes a one-turn conversation
(user: the question, assistant: the worked answer). Held-out problems are generated with another seed
and never occur in the training documents (the same rule as ``tools/fused_prefill.py``).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ANSWER = re.compile(r"#### (-?[0-9.,]+)")
HELD_OUT_SEED = 1_000_003  # the embedded mix's math documents use seed 0
TRAIN_DOCS = 20_000  # the embedded mix's default number of math documents
# decoding modes: (name, TextGenerator mode, prefill passes)
MODES = [("standard", "standard", 1), ("feedback", "feedback", 1), ("fused", "feedback", 2)]


def _problems(docs):
    for _, doc in docs:
        for part in doc.split("\n\n"):
            q, a = part.split("\nAnswer: ", 1)
            yield q.removeprefix("Question: "), a


def math_conversations(n_docs: int = TRAIN_DOCS, seed: int = 0) -> list[dict]:
    """Every worked problem of the first ``n_docs`` embedded math documents as a conversation."""
    from data_pipeline.embedded import math_documents

    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in _problems(math_documents(n_docs, seed))]


def write_conversations(path: str | Path, n_docs: int = TRAIN_DOCS, seed: int = 0) -> int:
    """Write the conversations as JSONL at ``path``; the number written. A file already there is replaced
    only when it is an earlier output of this function (its first line is the first conversation) or
    empty; anything else is refused in one sentence (:class:`UserError`), unchanged."""
    from fbt_megatron.errors import UserError
    from fbt_megatron.files import write_text_atomic

    convs = math_conversations(n_docs, seed)
    lines = [json.dumps(c) + "\n" for c in convs]
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--out {path} is a directory: give a file name, for example {path / 'math_chat.jsonl'}")
    if path.exists():
        try:
            with open(path, encoding="utf-8") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError):
            first = None
        if first not in ("", lines[0]):
            raise UserError(f"--out {path} exists and is not a conversations file this tool wrote: nothing was "
                            "changed; choose another --out, or move it away")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(lines))
    return len(convs)


def held_out_problems(n: int, train_docs: int = TRAIN_DOCS) -> list[tuple[str, str]]:
    """(question, worked answer) pairs from another seed, none of whose questions occurs in the
    training documents."""
    from data_pipeline.embedded import math_documents

    seen = {q for q, _ in _problems(math_documents(train_docs, 0))}
    out = []
    for q, a in _problems(math_documents(4 * n, HELD_OUT_SEED)):
        if q not in seen and len(out) < n:
            seen.add(q)
            out.append((q, a))
    return out


def final_answer(text: str) -> str | None:
    m = ANSWER.search(text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


def expected_passes(mix: list[float]) -> float:
    """Mean forward passes per step of a pass mix (``mix[i]``: probability of i+1 passes)."""
    return sum((i + 1) * p for i, p in enumerate(mix))


def measure(run_dir: str | Path, problems: list[tuple[str, str]], *, chat: bool, modes=None,
            max_new_tokens: int = 96, batch: int = 25, loaded=None) -> dict:
    """Greedy answers to ``problems`` in each decoding mode: exact match on ``#### N`` and generated
    tokens, per problem (for pairing) and summarised. ``chat``: the prompt is a user turn rendered with
    the checkpoint's chat template (an SFT run); otherwise the pretraining format ``Question: q\\nAnswer:``.
    ``loaded``: the run's :func:`load_for_inference` result, when the caller has it already.
    Call inside a world-of-one process group."""
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.generate.sampling import SamplingParams

    loaded = loaded or load_for_inference(run_dir)
    if loaded.feedback_config.fusion == "off":
        modes = [m for m in (modes or MODES) if m[0] == "standard"]
    prompts = [f"Question: {q}\nAnswer:" for q, _ in problems]
    ids = None
    if chat:
        from fbt_megatron.generate.chat import chat_prompt_ids, find_chat_template

        ids = chat_prompt_ids(loaded.tokenizer, find_chat_template(loaded.checkpoint), [q for q, _ in problems])
    stop = [] if chat else ["\n\n", "Question:"]  # a chat answer ends at its end-of-turn token (EOS)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
    out = {}
    for name, mode, k in modes or MODES:
        gen = TextGenerator(loaded, mode=mode, prefill_passes=k)
        lengths, correct = [], []
        for i in range(0, len(problems), batch):
            chunk = problems[i:i + batch]
            done = gen.generate(prompts[i:i + batch], params, prompt_ids=ids[i:i + batch] if ids else None)
            for (_, ref), c in zip(chunk, done):
                got = final_answer(c.text)
                correct.append(int(got is not None and got == final_answer(ref)))
                lengths.append(len(c.tokens))
        out[name] = {"exact_match": statistics.fmean(correct), "median_tokens": statistics.median(lengths),
                     "mean_tokens": statistics.fmean(lengths), "tokens": lengths, "correct": correct}
    return out


def paired_lengths(a: list[int], b: list[int]) -> dict:
    """Per-problem differences b - a of generated tokens (same problems, two decoding modes)."""
    d = [y - x for x, y in zip(a, b)]
    return {"mean_diff": statistics.fmean(d), "median_diff": statistics.median(d),
            "shorter": sum(x < 0 for x in d), "equal": sum(x == 0 for x in d), "longer": sum(x > 0 for x in d)}
