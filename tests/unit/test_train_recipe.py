"""Recipes are validated before any process group starts; errors name the key."""

from pathlib import Path

import pytest
import torch.distributed as dist

from fbt_megatron.train.lr_schedule import lr_at
from fbt_megatron.recipe import RecipeError, check_layout, load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_recipe_validates():
    r = load_recipe(ROOT / "recipes" / "tiny.yaml")
    assert r.name == "tiny"
    assert 0 < r.schedule.feedback_start_step < r.train.steps
    assert r.resolved_run_dir() == Path("runs/tiny")
    assert check_layout(r, 1) == 1



RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))  # research recipes too (recipes/research/)
# The paper-scale model and the SLURM recipes are Llama-class (issue 9).
LLAMA_RECIPES = ["1b.yaml"] + sorted(p.name for p in RECIPES if p.name.startswith("fbt-"))


def test_recipe_list_is_complete():
    assert {"tiny.yaml", "tiny_llama.yaml", "1b.yaml", "fbt-1b-400b.yaml", "fbt-13b.yaml"} <= {p.name for p in RECIPES}
    assert len(LLAMA_RECIPES) >= 5


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates(path):
    r = load_recipe(path)
    assert r.name and 0 < r.train.steps
    assert r.data.seq_length <= r.model.max_sequence_length


@pytest.mark.parametrize("name", LLAMA_RECIPES)
def test_big_recipes_are_llama_class(name):
    r = load_recipe(ROOT / "recipes" / name)
    m = r.model
    assert m.activation == "swiglu" and m.normalization == "RMSNorm"
    assert m.num_query_groups is not None and m.num_query_groups < m.num_attention_heads  # GQA
    assert not m.add_bias_linear and not m.tie_embeddings
    assert m.position_embedding_type == "rope"
    # the layout's TP and PP divide what they split (also checked by the loader; here for the record)
    p = r.parallel
    for size in (m.num_attention_heads, m.num_query_groups, m.hidden_size, m.ffn_size):
        assert size % p.tensor == 0
    assert m.num_layers % p.pipeline == 0


def test_slurm_1b_recipe_uses_the_1b_model():
    """fbt-1b-400b.yaml copies recipes/1b.yaml's model section (YAML recipes have no include)."""
    assert load_recipe(ROOT / "recipes" / "fbt-1b-400b.yaml").model == load_recipe(ROOT / "recipes" / "1b.yaml").model


def test_unknown_key_names_path_and_nearest():
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"model": {"hiden_size": 64}})
    assert "model.hiden_size" in str(e.value) and "model.hidden_size" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"optimiser": {"lr": 1}})
    assert "'optimiser'" in str(e.value) and "'optimizer'" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={}, overrides=["schedule.feedback_start=3"])
    assert "schedule.feedback_start" in str(e.value) and "schedule.feedback_start_step" in str(e.value)


def test_wrong_type_names_key():
    with pytest.raises(RecipeError) as e:
        load_recipe(data={}, overrides=["model.num_layers=many"])
    assert "model.num_layers" in str(e.value) and "many" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"parallel": {"zero_stage": 4}})
    assert "parallel.zero_stage" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"feedback": {"fusion": "multiply"}})
    assert "feedback.fusion" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"model": {"attention_mask": "packed"}})
    assert "model.attention_mask" in str(e.value) and "document_causal" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"precision": "fp16"})
    assert "'precision'" in str(e.value) and "bf16" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"feedback": {"grad_mode": "last", "loss_on": "mean"}})
    assert "loss_on='mean' needs feedback.grad_mode='all'" in str(e.value)
    with pytest.raises(RecipeError) as e:  # an option the chosen initialisation would silently ignore
        load_recipe(data={"feedback": {"value_init": "normal", "value_init_scale": 0.1}})
    assert "value_init_scale=0.1 applies to value_init='identity' only" in str(e.value)
    load_recipe(data={"feedback": {"value_init": "identity", "value_init_scale": 0.1}})


def test_overrides_apply_and_parse_yaml_scalars():
    r = load_recipe(data={}, overrides=["optimizer.lr=3e-4", "parallel.zero_stage=2", "schedule.mix=[0.5,0.5]",
                                        "logging.wandb=false", "name=x"])
    assert r.optimizer.lr == 3e-4 and r.parallel.zero_stage == 2 and r.schedule.mix == [0.5, 0.5]
    assert r.name == "x" and r.logging.wandb is False
    with pytest.raises(RecipeError):
        load_recipe(data={}, overrides=["optimizer.lr"])


def test_an_override_split_by_the_shell_is_one_sentence():
    """Unquoted, ``data.pipeline={sources: [...]}`` reaches the parser as several words, the first one
    ``data.pipeline={sources:``: its YAML error names the override and the quoting, no traceback."""
    with pytest.raises(RecipeError) as e:
        load_recipe(data={}, overrides=["data.pipeline={sources:", "[{name:", "mine,"])
    assert str(e.value) == ("override 'data.pipeline={sources:': the value is not valid YAML (expected the node "
                            "content, but found '<stream end>'); when the value has spaces, quote the whole "
                            "override, as in \"data.pipeline={sources: ...\"")


def test_a_pipeline_section_with_synthetic_data_is_refused():
    """data.pipeline without data.source=pipeline would be ignored: the run would train on generated tokens."""
    pipeline = {"sources": [{"name": "mine", "path": "data/mine", "weight": 1}], "tokenizer": "tok.model"}
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"data": {"source": "synthetic"}}, overrides=[f"data.pipeline={pipeline}"])
    assert ("data.pipeline is set but data.source is 'synthetic', which would ignore it; add data.source=pipeline "
            "to train on it, or data.pipeline=null for synthetic data") in str(e.value)
    assert load_recipe(data={"data": {"source": "pipeline", "pipeline": pipeline}},
                       overrides=["data.source=synthetic", "data.pipeline=null"]).data.pipeline is None
    # a checkpoint saved before this rule, by a run that trained on synthetic data beside a pipeline section,
    # still reads back (fbt ckpt verify, convert to-hf, a resume): the section it ignored is left out
    from fbt_megatron.recipe import load_saved_recipe

    saved = load_recipe(data={}).model_dump(mode="json")
    saved["data"].update(source="synthetic", pipeline=pipeline)
    assert load_saved_recipe(saved).data.pipeline is None
    assert load_recipe(data={"data": {"source": "pipeline", "pipeline": pipeline}}).data.pipeline == pipeline


def test_impossible_layouts_fail_with_key():
    r = load_recipe(data={"parallel": {"tensor": 2}})
    with pytest.raises(RecipeError) as e:
        check_layout(r, 3)
    assert str(e.value) == (
        "recipe key 'parallel.tensor': tensor=2 x pipeline=1 does not divide the process count 3: one copy of the "
        "model takes 2 processes, so launch a multiple of 2 (torchrun --nproc-per-node, fbt plan --gpus, fbt slurm "
        "submit --gpus-per-node) or set parallel.tensor to one of [1, 3]")
    # pipeline stages without the processes (fbt train without torchrun): the pipeline is named, not tensor
    with pytest.raises(RecipeError) as e:
        check_layout(load_recipe(data={"parallel": {"pipeline": 2}}), 1)
    assert str(e.value).startswith("recipe key 'parallel.pipeline': tensor=1 x pipeline=2 does not divide the process "
                                   "count 1: one copy of the model takes 2 processes, so launch a multiple of 2")
    assert str(e.value).endswith("or set parallel.pipeline to one of [1]")
    r = load_recipe(data={"batch": {"global_batch_size": 6, "micro_batch_size": 2}})
    with pytest.raises(RecipeError) as e:
        check_layout(r, 2)
    assert "batch.global_batch_size" in str(e.value)
    with pytest.raises(RecipeError) as e:  # TP must divide the model's sharded sizes
        load_recipe(data={"parallel": {"tensor": 3}, "model": {"hidden_size": 64, "num_attention_heads": 4}})
    assert "divisible by tensor parallel size 3" in str(e.value)
    with pytest.raises(RecipeError) as e:  # stages must split the layers evenly
        load_recipe(data={"parallel": {"pipeline": 3}, "model": {"num_layers": 4}})
    assert "parallel.pipeline=3 does not divide model.num_layers=4" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"parallel": {"pipeline": 2, "zero_stage": 3}})
    assert "parallel.zero_stage=3" in str(e.value)
    with pytest.raises(RecipeError) as e:
        check_layout(load_recipe(data={"batch": {"global_batch_size": 8, "micro_batch_size": 2,
                                                 "accumulation_steps": 3}}), 1)
    assert "batch.accumulation_steps" in str(e.value)


def test_batch_in_tokens():
    r = load_recipe(data={"batch": {"global_batch_tokens": 1024, "micro_batch_size": 4}, "data": {"seq_length": 64}})
    assert r.global_batch_size == 16 and r.tokens_per_step == 1024
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"batch": {"global_batch_tokens": 1000}, "data": {"seq_length": 64}})
    assert "batch.global_batch_tokens" in str(e.value)


def test_cli_rejects_bad_recipe_before_any_process_group(capsys, tmp_path):
    from fbt_megatron.launch.train_cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_sise: 64\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_sise" in err and "model.hidden_size" in err
    assert main([str(ROOT / "recipes" / "tiny.yaml"), "parallel.tensor=2"]) == 2  # 1 process
    assert "parallel.tensor" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_lr_schedules():
    kw = dict(lr=1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(99, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(50, kind="wsd", decay_fraction=0.2, **kw) == 1.0
    assert lr_at(79, kind="wsd", decay_fraction=0.2, **kw) == 1.0
    assert lr_at(99, kind="wsd", decay_fraction=0.2, **kw) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, kind="wsd", decay_fraction=0.2, **kw) < 1.0


def test_fusion_off_from_yaml_and_overrides(tmp_path):
    """YAML 1.1 reads a bare `off` as false: `fusion: off` in a recipe and `feedback.fusion=off` on the
    command line both mean a standard model (the data-efficiency tool's override failed on it)."""
    assert load_recipe(ROOT / "recipes/tiny.yaml", ["feedback.fusion=off"]).feedback.fusion == "off"
    text = (ROOT / "recipes/tiny.yaml").read_text().replace("fusion: glu", "fusion: off")
    assert "fusion: off" in text
    (tmp_path / "r.yaml").write_text(text)
    assert load_recipe(tmp_path / "r.yaml").feedback.fusion == "off"
