"""The vLLM side of the serving tests and benchmark, run with the vLLM venv's python (tests/support/vllm_env.py):

    python tests/support/side/vllm_side.py REQUEST.json RESULT.json
    python tests/support/side/vllm_side.py --calls JOB.json ANSWER_FD   (the benchmark: one engine kept for timed calls)

REQUEST: {"jobs": [{"name", "model", "engine": {LLM kwargs}, "prompts": [[ids]], "max_tokens",
"error": true (the engine must fail to start),
"preemptions": true (count the scheduler's preemptions: vLLM's ``vllm:num_preemptions`` counter),
"step_kinds": true (the plugin's forwards by path, ``FBTForCausalLM.step_kinds``, over all calls),
"late": {"prompt": [ids], "after_steps": N} (after the batch, the prompts but the last run again through the
engine's own step loop, and ``prompt`` added after N steps, while they decode: its tokens are
``late_tokens``, the plugin's forwards by path during that phase ``late_step_kinds``)}]}.
Each job starts an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor: no
engine or worker processes to start, ~5 s per engine instead of ~60 s), generates greedily, shuts it down.
``--calls``: the job's engine starts and makes one untimed call, then each line read on stdin makes one timed
call; every answer (started, then each call's seconds) is a JSON line on file descriptor ANSWER_FD (vLLM logs
to stdout); end of stdin shuts the engine down.
RESULT: {name: {"tokens": [[ids]], "preemptions", "step_kinds"} or {"error": message}}.
"""

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENGINE = dict(enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=16, seed=0,
              distributed_executor_backend="uni")


def inputs(job):
    """The job's prompts and greedy sampling parameters (fixed length: EOS ignored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True,
                            detokenize=not job.get("engine", {}).get("skip_tokenizer_init", False))
    return prompts, params


def run(job):
    from vllm import LLM

    engine = {**ENGINE, **job.get("engine", {})}
    if job.get("preemptions"):
        engine["disable_log_stats"] = False  # the Prometheus counters LLM.get_metrics reads
    try:
        llm = LLM(model=job["model"], **engine)
    except Exception as e:  # noqa: BLE001 - the message is the result
        if job.get("error"):
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-6000:]}
        raise
    try:
        out = llm.generate(*inputs(job), use_tqdm=False)
        res = {"tokens": [list(o.outputs[0].token_ids) for o in out]}
        if job.get("step_kinds"):
            res["step_kinds"] = llm.apply_model(lambda model: dict(model.step_kinds))[0]
        if job.get("late"):
            res.update(late(llm, job))
        if job.get("preemptions"):
            res["preemptions"] = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def late(llm, job):
    """The job's prompts but the last through ``LLMEngine.step``, and ``late.prompt`` added once they have run
    ``late.after_steps`` steps: scheduled among requests that decode (after the batch above, whose freed KV
    slots the new requests reuse)."""
    from vllm.inputs import TokensPrompt

    prompts, params = inputs(job)
    engine = llm.llm_engine
    kinds = lambda: llm.apply_model(lambda model: dict(model.step_kinds))[0]  # noqa: E731
    before = kinds()
    for i, p in enumerate(prompts[:-1]):
        engine.add_request(f"running-{i}", p, params)
    tokens = {}
    for step in range(10_000):
        if step == job["late"]["after_steps"]:
            engine.add_request("late", TokensPrompt(prompt_token_ids=job["late"]["prompt"]), params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests() and step >= job["late"]["after_steps"]:
            break
    after = kinds()
    return {"late_tokens": [tokens[f"running-{i}"] for i in range(len(prompts) - 1)] + [tokens["late"]],
            "late_step_kinds": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def serve_calls(job, answer_fd: int) -> None:
    from vllm import LLM

    answers = os.fdopen(answer_fd, "w", buffering=1)
    llm = LLM(model=job["model"], **{**ENGINE, **job.get("engine", {})})
    try:
        prompts, params = inputs(job)
        llm.generate(prompts, params, use_tqdm=False)
        answers.write(json.dumps({"started": True}) + "\n")
        for _ in sys.stdin:
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            answers.write(json.dumps({"seconds": time.perf_counter() - t}) + "\n")
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--calls":
        serve_calls(json.load(open(sys.argv[2])), int(sys.argv[3]))
        sys.exit(0)
    request, result = sys.argv[1:3]
    jobs = json.load(open(request))["jobs"]
    results = {}
    for job in jobs:
        results[job["name"]] = run(job)
        if job.get("error") and "error" not in results[job["name"]]:
            results[job["name"]] = {"error": None, **results[job["name"]]}
    json.dump(results, open(result, "w"))
