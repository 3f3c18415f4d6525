"""fusion="off" is exactly Megatron-Core's plain GPT model; "additive" is a different model."""

import torch
from megatron.core.models.gpt import GPTModel

from fbt_megatron.model.attention import adapt_layer_spec
from fbt_megatron.model.fbt_gpt import build_model, layer_spec
from tests.support.model_helpers import feedback, make_inputs, tiny_model_config


def test_fusion_off_is_plain_megatron_gpt(single_process):
    cfg = tiny_model_config(vocab_pad_multiple=64, attention_mask="causal")  # no padding (no -inf columns); plain causal mask
    torch.manual_seed(0)
    fbt = build_model(cfg, feedback(fusion="off")).eval()
    assert fbt.feedback is None
    # Megatron's GPTModel with the same layers (the local spec with the project's SDPA core attention)
    spec = adapt_layer_spec(layer_spec(cfg), cfg.attention_mask, cfg.num_layers)
    plain = GPTModel(
        config=fbt.config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length, position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    ).eval()
    missing = plain.load_state_dict({k.removeprefix("gpt."): v for k, v in fbt.state_dict().items()}, strict=True)
    assert not missing.missing_keys
    ids, labels, doc_start = make_inputs()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        for k in (1, 3):  # passes are meaningless without fusion: always the plain forward
            assert torch.equal(fbt(ids, positions, doc_start, num_passes=k).logits, plain(ids, positions, mask))
            assert torch.equal(fbt(ids, positions, doc_start, labels=labels).token_loss, plain(ids, positions, mask, labels=labels))


def test_additive_fusion_is_symmetric_sum(single_process):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(fusion="additive"))
    state, emb = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    fb = model.feedback
    expected = state @ fb.value.weight.t() + emb @ fb.gate.weight.t()
    torch.testing.assert_close(fb(state, emb), expected)
    glu = build_model(tiny_model_config(), feedback(fusion="glu")).feedback
    torch.testing.assert_close(glu(state, emb), (state @ glu.value.weight.t()) * torch.sigmoid(emb @ glu.gate.weight.t()))


def test_a_run_without_fusion_trains_one_pass_every_step(tmp_path, single_process):
    """The mix draws 2 and 3 passes from step 2 (TINY), but a model without a fusion has no state to read:
    its steps are one pass each, in the history (which the MFU that training logs counts from) and the
    pass counts, and its plan's deepest pass is 1."""
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.resolve.resolver import resolve_run
    from tests.support.training import tiny_recipe, train_fn

    data = tiny_recipe(tmp_path / "run", feedback={"fusion": "off"})
    assert resolve_run(load_recipe(data=data), 1).max_passes == 1
    summary = train_fn(data)
    assert [h[1] for h in summary["history"]] == [1] * 6
    assert summary["pass_counts"] == {"1": 6}
    with_fusion = tiny_recipe(tmp_path / "run", feedback={"fusion": "glu"})
    assert resolve_run(load_recipe(data=with_fusion), 1).max_passes == 3  # the same mix with a fusion
