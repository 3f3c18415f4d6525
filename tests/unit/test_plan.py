"""`fbt plan` against hand-computed parameters, FLOPs and memory for two configurations."""

import dataclasses

import pytest

from fbt_megatron.launch.plan import GB, Layout, Shape, format_plan, memory_per_gpu, pass_factor, plan
from fbt_megatron.recipe import load_recipe


def test_tiny_recipe_counts_by_hand():
    r = load_recipe("recipes/tiny.yaml")  # L=4 h=128 f=512 V=4096 S=128, tied, GLU fusion
    s = Shape.from_recipe(r)
    # per layer: qkv 3h^2 + proj h^2 + fc1/fc2 2hf = 196,608 weights; biases 3h+h+f+h = 1,152;
    # two LayerNorms 4h = 512  -> 198,272; x4 = 793,088; final norm 256; embedding 524,288;
    # fusion W_U, W_G 32,768 + h_init 128  -> 1,350,528 (what the built model has, see the docs' check)
    assert s.params() == 1_350_528
    # forward FLOPs/token of the stack: 2 * (4 * 196,608 + 524,288) + 4 * L * S * h = 2,621,440 + 262,144;
    # of the fusion 2 * 2h^2 = 65,536, only in passes that read a state (2..k)
    F, PHI = 2_883_584, 65_536
    assert s.forward_flops_per_token() == F
    assert s.step_flops_per_token(1) == 3 * F  # the ordinary first pass: no fusion
    assert s.step_flops_per_token(3) == 3 * (3 * F + 2 * PHI)
    assert s.step_flops_per_token(3, "last") == 3 * F + 2 * PHI + 2 * (F + PHI)  # backward: the last pass
    stack = dataclasses.replace(s, fusion=False)  # the stack's share alone
    assert pass_factor([0.75, 0.22, 0.03], "all", stack) == pytest.approx(1.28)
    assert pass_factor([0.75, 0.22, 0.03], "last", stack) == pytest.approx(3.28 / 3)
    assert pass_factor([0.75, 0.22, 0.03], "all", s) == pytest.approx(1.28 + (0.22 + 0.03 * 2) * PHI / F)
    state = Shape.from_recipe(load_recipe("recipes/tiny.yaml", ["feedback.first_input=state"]))
    assert state.step_flops_per_token(1) == 3 * (F + PHI)  # the ablation fuses in every pass

    # CPU fp32, TP=1 ZeRO-0, micro-batch 8, DP=1, 3 passes kept (grad_mode all), eager attention
    m = memory_per_gpu(s, Layout(1, 1, 0, 8), 1, 3, weight_bytes=4, grad_bytes=4, optimizer_bytes=8,
                       act_bytes=4, flash=False, reserve=0)
    assert m.weights == 4 * 1_350_528 and m.grads == 4 * 1_350_528 and m.optimizer == 8 * 1_350_528
    # per layer: s*b*h*34 + 5*a*s^2*b = 4,456,448 + 2,621,440 bytes at 2-byte activations, x2 for fp32
    assert m.activations == (4_456_448 + 2_621_440) * 2 * 4 * 3
    assert m.logits == 128 * 8 * 4096 * 8


def test_tp2_zero2_by_hand():
    s = Shape(layers=2, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=2048)
    # per layer 4,194,304 + 8,388,608 + 5*1024 + 4096 + 4*1024 = 12,596,224; x2 + 2,048 + 32,768,000 + 2,098,176
    assert s.params() == 60_060_672
    m = memory_per_gpu(s, Layout(tp=2, pp=1, zero=2, micro_batch=1), dp=4, passes_kept=3)
    n = 60_060_672 / 2
    assert m.weights == 2 * n and m.grads == 4 * n / 4 and m.optimizer == 12 * n / 4
    # flash attention, TP=2 without sequence parallelism: s*b*h*(24/2 + 10) per layer, 2 layers, 3 passes
    assert m.activations == 2048 * 1024 * 22 * 2 * 3
    assert m.logits == 2048 * 32000 / 2 * 6
    assert m.total == pytest.approx(60_060_672 + 30_030_336 + 90_091_008 + 276_824_064 + 196_608_000 + 5e9)


def test_plan_1b_on_64_h100_and_a_layout_that_does_not_fit():
    r = load_recipe("recipes/fbt-1b-400b.yaml")
    pl = plan(r, 64, "h100", 0.40)
    assert pl.fits and 1.0e9 < pl.params < 1.15e9  # TinyLlama-1.1B shapes + the fusion
    tokens = sum(p["tokens"] for p in pl.phases)
    assert 399e9 < tokens < 401e9
    feedback = pl.phases[1]
    # E[k] = 1.28 stack forwards-and-backwards, plus the fusion in 0.22 x 1 + 0.03 x 2 passes per step
    s = pl.shape
    F, PHI = s.forward_flops_per_token(), 4 * s.hidden ** 2
    assert pl.flops_per_token_single == 3 * F
    assert feedback["flops_per_token"] == pytest.approx(3 * (1.28 * F + 0.28 * PHI))
    # wall time = tokens * FLOPs/token / (MFU * peak * GPUs)
    assert feedback["seconds"] == pytest.approx(feedback["tokens"] * feedback["flops_per_token"] / (0.4 * 989e12 * 64))

    big = load_recipe("recipes/fbt-13b.yaml", ["parallel.tensor=1", "parallel.zero_stage=1", "parallel.sequence_parallel=false"])
    pl = plan(big, 64, "h100", 0.40)
    assert not pl.fits and pl.suggestion is not None
    lay, mem = pl.suggestion
    assert mem.total <= 80 * GB and (lay.tp > 1 or lay.zero > 1)


def test_llama_recipe_counts_by_hand():
    r = load_recipe("recipes/tiny_llama.yaml")  # L=4 h=128 a=4 g=2 f=352 SwiGLU V=4096 S=128, untied, no biases
    s = Shape.from_recipe(r)
    assert (s.gated, s.bias, s.tied, s.norm_params, s.kv_width) == (True, False, False, 1, 64)
    # per layer: q h^2 + k, v 2 x h x 64 + proj h^2 = 49,152; SwiGLU fc1 [gate; up] 2hf + fc2 hf = 135,168;
    # two RMSNorms 2h = 256 -> 184,576; x4 = 738,304; final norm 128; embedding + output 2 x 524,288;
    # fusion W_U, W_G 32,768 + h_init 128 -> 1,819,904
    assert s.params() == 1_819_904
    # forward of the stack: 2 * (4 * 184,320 + 524,288) + 4 * L * S * h (the fusion apart)
    assert s.forward_flops_per_token() == 2_523_136 + 262_144
    m = memory_per_gpu(s, Layout(1, 1, 0, 8), 1, 1, flash=True, reserve=0)
    # activations: s*b*h*(4 + 4g/a + 6f/h + 10) per layer at 2 bytes: 4 + 2 + 16.5 + 10 = 32.5
    assert m.activations == 128 * 8 * 128 * 32.5 * 4


@pytest.mark.parametrize("recipe", ["tiny.yaml", "tiny_llama.yaml"])
def test_parameter_count_matches_the_built_model(single_process, recipe):
    from fbt_megatron.model.fbt_gpt import build_model

    r = load_recipe(f"recipes/{recipe}")
    model = build_model(r.model, r.feedback)
    assert sum(p.numel() for p in model.parameters()) == Shape.from_recipe(r).params(r.feedback.bias)


def test_pipeline_activation_memory_follows_the_schedule():
    """The first stage holds P stage-passes at k = 1 and 2(P-1) + (k-1)P + 1 with k kept passes
    (the feedback schedule's warm-up; docs/pipeline.md), each of L/P layers."""
    shape = Shape(layers=8, hidden=64, heads=4, ffn=256, vocab=128, seq=32)
    per_pass = memory_per_gpu(shape, Layout(1, 1, 1, 2), 1, 1).activations  # PP=1, one pass: all 8 layers
    for pp, k, held in ((2, 1, 2), (2, 2, 5), (2, 3, 7), (4, 2, 11)):
        got = memory_per_gpu(shape, Layout(1, pp, 1, 2), 1, k).activations
        assert got == pytest.approx(per_pass / pp * held), (pp, k)
    assert memory_per_gpu(shape, Layout(1, 1, 1, 2), 1, 3).activations == pytest.approx(3 * per_pass)


def test_pipeline_zero2_keeps_whole_gradients():
    """Under a pipeline ZeRO-2 holds the step's gradients whole (as ZeRO-1 does); without one it shards them."""
    s = Shape(layers=2, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=2048)
    n = 60_060_672 / 2  # per stage (PP=2), TP=1
    piped = memory_per_gpu(s, Layout(tp=1, pp=2, zero=2, micro_batch=1), dp=4, passes_kept=1)
    assert piped.grads == 4 * n and piped.optimizer == 12 * n / 4
    flat = memory_per_gpu(s, Layout(tp=1, pp=1, zero=2, micro_batch=1), dp=4, passes_kept=1)
    assert flat.grads == 4 * 2 * n / 4


def test_suggestion_with_tensor_and_pipeline_parallelism_uses_sequence_parallelism():
    """6 heads (TP=4 does not divide them) and 14 GB per GPU: only TP=2 x PP=4 fits, and a suggestion with
    TP > 1 turns sequence parallelism on whatever the pipeline size."""
    from fbt_megatron.launch.plan import gradient_buffers, suggest_layout

    s = Shape(layers=16, hidden=3072, heads=6, ffn=12288, vocab=32000, seq=4096)
    layout, mem = suggest_layout(s, 8, 64, 14 * GB, 1, {}, allow_pp=True)
    assert (layout.tp, layout.pp, layout.sequence_parallel) == (2, 4, True)
    assert mem == memory_per_gpu(s, layout, 1, 1, **gradient_buffers(layout.zero, 1, fp32=False))


def test_bf16_gradients_and_reduction_buckets_by_hand():
    """DeepSpeed's bf16 ``.grad`` (2 bytes a parameter before it reaches the fp32 accumulator) and its flat
    reduction bucket (<= 5e8 elements) are counted: whole at ZeRO-2, one V x h weight at ZeRO-1 (released
    as added), none of either in fp32 or over one DP rank."""
    from fbt_megatron.launch.plan import gradient_buffers

    s = Shape(layers=2, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=2048)
    n = 60_060_672 / 2  # TP=2 (test_tp2_zero2_by_hand)
    base = memory_per_gpu(s, Layout(tp=2, pp=1, zero=2, micro_batch=1), dp=4, passes_kept=3).grads
    zero2 = memory_per_gpu(s, Layout(tp=2, pp=1, zero=2, micro_batch=1), dp=4, passes_kept=3,
                           **gradient_buffers(2, 4, fp32=False))
    assert zero2.grads == base + 2 * n + 2 * n  # every bf16 .grad + a bf16 bucket of n < 5e8 elements
    zero1 = memory_per_gpu(s, Layout(tp=2, pp=1, zero=1, micro_batch=1), dp=4, passes_kept=3,
                           **gradient_buffers(1, 4, fp32=False))
    assert zero1.grads == 4 * n + 2 * 32000 * 1024 / 2 + 4 * n  # fp32 accumulators + one V x h/TP + fp32 bucket
    big = Shape(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, seq=2048, query_groups=8, gated=True,
                bias=False, tied=False, norm_params=1)
    capped = memory_per_gpu(big, Layout(1, 1, 1, 1), 8, 1, **gradient_buffers(1, 8, fp32=False))
    assert capped.detail["reduce_buckets"] == 5e8 * 4  # 11.4e9 parameters: the bucket is capped
    assert gradient_buffers(1, 1, fp32=False) == {"half_grad_bytes": 2, "half_grads_released": True}
    assert gradient_buffers(2, 8, fp32=True) == {"reduce_bucket_bytes": 4}


def test_a_model_without_fusion_is_planned_as_one_single_pass_phase(tmp_path):
    """``fbt plan`` and the resolved run of a standard model (``feedback.fusion=off``): every step one pass, so
    one single-pass phase of all the steps, and no mix or switch in the resolved passes."""
    from fbt_megatron.resolve.resolver import resolve_run

    recipe = load_recipe("recipes/tiny.yaml", ["feedback.fusion=off", f"run_dir={tmp_path / 'run'}"])
    pl = plan(recipe, 1, "cpu", 0.3, peak=1e12)
    assert [(p["name"], p["steps"]) for p in pl.phases] == [("1: single-pass", recipe.train.steps)]
    (flops,) = [line for line in format_plan(pl, recipe, 1, "cpu", 0.3, 1e12).splitlines() if line.startswith("FLOPs")]
    assert "no feedback mix (feedback.fusion: off" in flops and "x1.000" not in flops, flops
    passes = resolve_run(recipe, 1).derived()["passes"]
    assert (passes["mix"], passes["feedback_start_step"], passes["max_passes"]) == (None, None, 1)
