"""Generation: KV-cache decoding with latent feedback against the sequential recurrence, prefill
passes, padded batches, sampling, and a TP=2 checkpoint against TP=1."""

import pytest
import torch

from tests.support.model_helpers import feedback, tiny_model_config

TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_model(seed=0, **feedback_overrides):
    from fbt_megatron.generate.model import build_inference_model

    torch.manual_seed(seed)
    model = build_inference_model(tiny_model_config(max_sequence_length=48), feedback(**feedback_overrides))
    with torch.no_grad():  # a fed-back state that matters: W_U at full scale, not depth-scaled
        model.feedback.value.weight.normal_(0.0, 0.3)
    return model


def ids(n, seed, vocab=64):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_cache_feedback_decoding_equals_sequential_recurrence(single_process):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.model.sequential import sequential_forward

    model = tiny_model()
    seq = ids(14, 1)
    reference = sequential_forward(model, torch.tensor([seq])).logits[0]  # [S, V]
    for prompt_len, passes in ((1, 1), (4, "exact")):
        session = FeedbackDecoder(model, "feedback", passes).session([seq[:prompt_len]], len(seq) - prompt_len)
        logits = [session.prefill()[0]] + [session.step(torch.tensor([t]))[0] for t in seq[prompt_len:-1]]
        torch.testing.assert_close(torch.stack(logits), reference[prompt_len - 1:-1], **TOL)
    # without feedback the cached decode is the 1-pass forward (the plain transformer)
    plain = model(torch.tensor([seq]), num_passes=1).logits[0]
    session = FeedbackDecoder(model, "standard").session([seq[:3]], len(seq) - 3)
    logits = [session.prefill()[0]] + [session.step(torch.tensor([t]))[0] for t in seq[3:-1]]
    torch.testing.assert_close(torch.stack(logits), plain[2:-1], **TOL)
    # ... and it differs from feedback decoding (the test can see the feedback)
    assert (torch.stack(logits) - reference[2:-1]).abs().max() > 1e-3


def test_prefill_passes(single_process):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.model.sequential import sequential_forward

    model = tiny_model()
    prompt = ids(9, 2)
    exact = sequential_forward(model, torch.tensor([prompt])).logits[0]
    # K = prompt length Jacobi passes == the exact recurrence == token-by-token "exact" prefill
    for passes in (len(prompt), "exact"):
        _, every = FeedbackDecoder(model, "feedback", passes).session([prompt], 4).prefill(return_all=True)
        torch.testing.assert_close(every[0], exact, **TOL)
    # K passes: exactly the first K positions are exact, as in training's multi-pass forward
    for k in (1, 2):
        _, every = FeedbackDecoder(model, "feedback", k).session([prompt], 4).prefill(return_all=True)
        torch.testing.assert_close(every[0], model(torch.tensor([prompt]), num_passes=k).logits[0], **TOL)
        torch.testing.assert_close(every[0, :k], exact[:k], **TOL)
        assert (every[0, k:] - exact[k:]).abs().max() > 1e-4


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_equals_each_prompt_alone(single_process, padding):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.sampling import SamplingParams

    model = tiny_model()  # rope
    prompts = [ids(3, 3), ids(7, 4), ids(1, 5)]
    params = SamplingParams(max_new_tokens=6)
    for mode, passes in (("feedback", 1), ("feedback", 2), ("feedback", "exact"), ("standard", 1)):
        decoder = FeedbackDecoder(model, mode, passes)
        batched = decoder.generate(prompts, params, padding=padding, return_logits=True)
        for b, p in enumerate(prompts):
            alone = decoder.generate([p], params, return_logits=True)
            assert batched.tokens[b] == alone.tokens[0], (mode, passes, b)
            torch.testing.assert_close(batched.logits[b], alone.logits[0], **TOL)


def tiny_model_absolute():
    from fbt_megatron.generate.model import build_inference_model

    torch.manual_seed(0)
    cfg = tiny_model_config(max_sequence_length=48, position_embedding_type="learned_absolute")
    return build_inference_model(cfg, feedback())


def test_padded_batch_learned_positions_and_sampling(single_process):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.sampling import SamplingParams

    model = tiny_model_absolute()
    prompts = [ids(2, 6), ids(5, 7)]
    decoder = FeedbackDecoder(model, "feedback", 2)
    greedy = SamplingParams(max_new_tokens=5)
    batched = decoder.generate(prompts, greedy, padding="left", return_logits=True)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(batched.logits[b], decoder.generate([p], greedy, return_logits=True).logits[0], **TOL)
    # seeded sampling is reproducible; a different seed changes the draw (near-uniform tiny model)
    hot = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, top_k=40, seed=3)
    a, b = decoder.generate(prompts, hot), decoder.generate(prompts, hot)
    assert a.tokens == b.tokens
    c = decoder.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, top_k=40, seed=4))
    assert c.tokens != a.tokens
    # stop callback and EOS end a sequence early
    out = decoder.generate(prompts, SamplingParams(max_new_tokens=8), is_stopped=lambda b, t: len(t) >= 2)
    assert [len(t) for t in out.tokens] == [2, 2] and out.finish_reasons == ["stop", "stop"]
    first = batched.tokens[0][0]
    out = decoder.generate(prompts[:1], greedy, eos_id=first)
    assert out.tokens == [[]] and out.finish_reasons == ["eos"]


def test_filter_logits_top_k_top_p():
    from fbt_megatron.generate.sampling import filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [[True, False, False, False]]


def test_bad_generation_arguments(single_process):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.sampling import SamplingParams

    model = tiny_model()
    with pytest.raises(ValueError, match="prefill_passes"):
        FeedbackDecoder(model, "feedback", 0)
    with pytest.raises(ValueError, match="mode"):
        FeedbackDecoder(model, "fast")
    with pytest.raises(ValueError, match="max_sequence_length=48"):
        FeedbackDecoder(model).generate([ids(40, 1)], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


RECURRENCE_CASES = [({}, {}), ({"position_embedding_type": "learned_absolute"}, {}), ({}, {"first_input": "state"}),
                    ({}, {"mixin": "bounded", "prefix_mixin": 0.3}), ({}, {"fusion": "additive", "bias": True}),
                    ({}, {"prefix_mixin": 0.0})]


@pytest.mark.parametrize("model_cfg,feedback_cfg", RECURRENCE_CASES)
def test_exact_recurrence_of_the_studys_variants(single_process, model_cfg, feedback_cfg):
    """Each model variant the study trains: the documents decoded through the cache against the recurrence
    written from the formulas, on rows whose first token is marked a start or not and with a one-token
    document at a row's end."""
    from fbt_megatron.generate.model import build_inference_model
    from fbt_megatron.generate.recurrence import document_recurrence_logits
    from fbt_megatron.model.sequential import sequential_forward
    from tests.support.model_helpers import make_inputs

    torch.manual_seed(3)
    model = build_inference_model(tiny_model_config(max_sequence_length=48, **model_cfg), feedback(**feedback_cfg))
    with torch.no_grad():
        model.feedback.value.weight.normal_(0.0, 0.3)
    input_ids, _, doc_start = make_inputs(batch=2, seq=10)
    doc_start[0, 0] = doc_start[1, 9] = True
    want = sequential_forward(model, input_ids, doc_start=doc_start).logits[..., :model.model_config.vocab_size]
    torch.testing.assert_close(document_recurrence_logits(model, input_ids, doc_start), want.float(), **TOL)


def test_exact_recurrence_of_packed_documents_is_the_sequential_reference(single_process):
    """Rows of several documents, each decoded alone through the cache, against the recurrence written
    from the formulas (document resets, positions from each document's start); the loss is the
    token-weighted cross entropy of those logits, and 'causal' attention is refused."""
    from fbt_megatron.generate.recurrence import document_recurrence_logits, documents, exact_recurrence_loss
    from fbt_megatron.model.sequential import sequential_forward
    from tests.support.model_helpers import make_inputs

    model = tiny_model(seed=2)
    input_ids, labels, doc_start = make_inputs(batch=2, seq=10)
    assert documents(doc_start) == [(0, 0, 4), (0, 4, 10), (1, 0, 3), (1, 3, 7), (1, 7, 10)]
    marked = doc_start.clone()
    marked[:, 0] = True  # a loader may mark a row's first token: the same documents
    assert documents(marked) == documents(doc_start)
    want = sequential_forward(model, input_ids, doc_start=doc_start).logits[..., :model.model_config.vocab_size]
    for at_once in (256, 2):  # every document in one session, or sessions of two
        got = document_recurrence_logits(model, input_ids, doc_start, documents_at_once=at_once)
        torch.testing.assert_close(got, want.float(), **TOL)
    # ... and not what one pass gives (the check can see the recurrence)
    one_pass = model(input_ids, doc_start=doc_start, num_passes=1).logits[..., :model.model_config.vocab_size]
    assert (one_pass - want).abs().max() > 1e-3
    mask = torch.ones(2, 10)
    mask[1, 9] = 0.0
    batches = [{"input_ids": input_ids, "labels": labels, "loss_mask": mask, "doc_start": doc_start}]
    nll = -torch.log_softmax(want.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert exact_recurrence_loss(model, batches) == pytest.approx(float((nll * mask).sum() / mask.sum()), rel=1e-6)
    model.model_config.attention_mask = "causal"
    with pytest.raises(ValueError, match="document_causal"):
        document_recurrence_logits(model, input_ids, doc_start)


def test_exact_recurrence_loss_over_batches_decoded_together_is_each_batchs_reference(single_process, monkeypatch):
    """Batches of 3, 1, 2 and 2 rows (the second without ``doc_start``: one document a row; the last 12
    tokens wide), their rows decoded together two at a time, a batch at a time, all of one width at once,
    or as a budget of logits allows (sessions of at most 3 documents of 10 tokens): the token-weighted loss
    of each batch's own recurrence, written from the formulas (``sequential_forward``) batch by batch, with
    a masked position."""
    from fbt_megatron.generate import recurrence
    from fbt_megatron.generate.recurrence import documents, exact_recurrence_loss
    from fbt_megatron.model.sequential import sequential_forward
    from tests.support.model_helpers import make_inputs

    model = tiny_model(seed=4)
    batches, total, weight = [], 0.0, 0.0
    for rows, seed, marked, seq in ((3, 1, True, 10), (1, 2, False, 10), (2, 3, True, 10), (2, 4, True, 12)):
        ids, labels, starts = (t[:rows] for t in make_inputs(batch=max(rows, 2), seq=seq, seed=seed))
        starts = starts if marked else torch.zeros_like(starts)
        mask = torch.ones(rows, seq)
        mask[0, seed] = 0.0
        batch = {"input_ids": ids, "labels": labels, "loss_mask": mask}
        batches.append(batch | {"doc_start": starts} if marked else batch)
        logits = sequential_forward(model, ids, doc_start=starts).logits[..., :model.model_config.vocab_size]
        nll = -torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        total, weight = total + float((nll * mask).sum()), weight + float(mask.sum())
    for rows_at_once in (2, 1, 256):
        assert exact_recurrence_loss(model, batches, rows_at_once=rows_at_once) == pytest.approx(total / weight, rel=1e-6)
    monkeypatch.setattr(recurrence, "LOGITS_AT_ONCE", 3 * 10 * model.model_config.vocab_size)
    sessions, session = [], recurrence.FeedbackDecoder.session
    monkeypatch.setattr(recurrence.FeedbackDecoder, "session",
                        lambda self, prompts, *a, **k: sessions.append(prompts) or session(self, prompts, *a, **k))
    assert exact_recurrence_loss(model, batches) == pytest.approx(total / weight, rel=1e-6)
    assert max(len(p) * max(map(len, p)) for p in sessions) <= 3 * 10 and sum(map(len, sessions)) == 6 + 1 + 5 + 5
    assert documents(torch.zeros(0, 10, dtype=torch.bool)) == []
