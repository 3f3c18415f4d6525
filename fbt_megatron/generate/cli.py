"""``fbt generate RUN_DIR_OR_CHECKPOINT (--prompt TEXT ... | --prompts-file FILE) [options]``

Generates with latent feedback from a trained run (its latest checkpoint) or one checkpoint
directory, saved in any parallel layout. One prompt streams to the terminal as it is generated;
several are decoded as one padded batch and printed in order. Under torchrun the model is split
with tensor parallelism over the processes (rank 0 prints):

    fbt generate runs/tiny --prompt "def "
    fbt generate runs/tiny --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1
    fbt generate runs/tiny --prompt "x = " --mode standard            # no feedback, for comparison
    fbt generate runs/tiny --prompts-file long.txt --truncate left    # keep each prompt's last tokens
    fbt generate runs/tiny_sft --chat --system "Answer briefly." --prompt "What is 3 + 4?"
    torchrun --nproc-per-node 2 -m fbt_megatron.cli generate runs/tiny --prompt "def "
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from data_pipeline.argtypes import number, positive_int


def parse_args(argv):
    p = argparse.ArgumentParser(prog="fbt generate", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="run directory (uses checkpoints/latest) or a checkpoint step_N directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable); \\n and \\t escapes are read")
    src.add_argument("--prompts-file", help="one prompt per line, or a .jsonl with a 'prompt' field per line")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=number(float, ge=0), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=number(int, ge=0), default=0, help="0 = off")
    p.add_argument("--top-p", type=number(float, gt=0, le=1), default=1.0)
    p.add_argument("--seed", type=number(int, ge=0), default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mode", choices=["feedback", "standard"], default="feedback")
    p.add_argument("--prefill-passes", default="2", help="1, 2 (FUSED, default), any K, or 'exact'")
    p.add_argument("--padding", choices=["left", "right"], default="left")
    p.add_argument("--truncate", choices=["none", "left"], default="none",
                   help="a prompt longer than the context leaves room for: refuse it (none, default) or keep "
                        "its last tokens (left)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts decoded together")
    p.add_argument("--tokenizer", help="a sentencepiece .model, a tokenizer.json or a folder of either; for a checkpoint without the run's copy (another one is refused)")
    p.add_argument("--chat", action="store_true",
                   help="apply the checkpoint's chat template (an `fbt sft` run): each prompt is a user turn")
    p.add_argument("--system", help="with --chat: a system prompt before each user turn")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--no-stream", action="store_true")
    return p.parse_args(argv)


def read_prompts(args) -> list[str]:
    if args.prompt:
        return [s.replace("\\n", "\n").replace("\\t", "\t") for s in args.prompt]
    path = args.prompts_file
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts-file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    if path.endswith(".jsonl"):
        prompts = []
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e.msg}, column {e.colno})") from None
                if "prompt" not in row:
                    raise ValueError(f"{path}:{i}: no 'prompt' field")
                prompts.append(row["prompt"])
        return prompts
    return [line for line in lines if line.strip()]


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from fbt_megatron import errors, runtime
    from fbt_megatron.generate.api import PromptTooLong, TextGenerator
    from fbt_megatron.generate.decoder import parse_prefill_passes
    from fbt_megatron.generate.loading import CheckpointNotFound
    from fbt_megatron.generate.sampling import SamplingParams

    try:
        prompts = read_prompts(args)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
        passes = parse_prefill_passes(args.prefill_passes)
        if not prompts:
            raise ValueError("no prompts given")
        if args.system and not args.chat:
            raise ValueError("--system applies to --chat")
    except (ValueError, FileNotFoundError) as e:
        return errors.report("fbt generate", e)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not runtime.use_cuda() else "cuda")
    runtime.quiet_known_warnings()
    try:
        gen = TextGenerator.from_checkpoint(args.checkpoint, tokenizer=args.tokenizer, mode=args.mode,
                                            prefill_passes=passes)
    except (CheckpointNotFound, FileNotFoundError, ValueError, errors.UserError) as e:
        runtime.shutdown()
        return errors.report("fbt generate", e)
    import torch.distributed as dist

    chat_ids, shown = None, prompts  # shown: each prompt as echoed, the text the model sees
    if args.chat:
        from fbt_megatron.generate.chat import chat_prompt_ids, chat_prompt_texts, find_chat_template

        try:
            template = find_chat_template(gen.loaded.checkpoint)
            chat_ids = chat_prompt_ids(gen.tokenizer, template, prompts, args.system)
            shown = chat_prompt_texts(gen.tokenizer, template, prompts, args.system)
        except FileNotFoundError as e:
            runtime.shutdown()
            return errors.report("fbt generate", e)

    try:  # every prompt must fit before the first is generated (or be cut: --truncate left)
        gen.fit_prompts(chat_ids if chat_ids is not None else [gen.encode(p) for p in prompts],
                        params.max_new_tokens, args.truncate)
    except PromptTooLong as e:
        runtime.shutdown()
        return errors.report("fbt generate", e)

    rank0 = dist.get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    stream = len(prompts) == 1 and not args.no_stream and not args.json and rank0
    try:
        for start in range(0, len(prompts), args.batch_size):
            chunk = prompts[start:start + args.batch_size]
            ids = chat_ids[start:start + args.batch_size] if chat_ids is not None else None
            if stream:
                sys.stdout.write(shown[start])
                sys.stdout.flush()
            done = gen.generate(chunk, params, padding=args.padding, prompt_ids=ids, truncate=args.truncate,
                                stream=(lambda b, delta: (sys.stdout.write(delta), sys.stdout.flush())) if stream else None)
            for j, c in enumerate(done):
                if args.json:
                    row = {"prompt": c.prompt, "completion": c.text, "tokens": len(c.tokens),
                           "finish_reason": c.finish_reason}
                    if ids is not None:
                        row["prompt_ids"] = ids[j]
                    say(json.dumps(row))
                elif stream:
                    say(f"\n[{len(c.tokens)} tokens, {c.finish_reason}]")
                else:
                    say(f"{shown[start + j]}{c.text}\n[{len(c.tokens)} tokens, {c.finish_reason}]\n")
        return 0
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
