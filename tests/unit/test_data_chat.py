"""Chat data (issue 22): the per-token loss mask of a rendered conversation, token by token; the mask
through the loader; bad conversations counted by kind (or refused under --strict); a chat dataset
without its template refused by name; packed conversations never attend to each other."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.chat_helpers import build_chat_fixture, chat_data_section


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_chat_fixture(tmp_path_factory.mktemp("chat"))


def test_loss_mask_is_the_assistant_tokens_and_their_end_of_turn_token_by_token(fx):
    from data_pipeline.chat import chat_tokenizer, encode_conversation

    tok = chat_tokenizer(fx["tokenizer"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"},
            {"role": "assistant", "content": "7"}, {"role": "user", "content": "and x2?"},
            {"role": "assistant", "content": "14"}]
    ids, mask = encode_conversation(tok, msgs)
    eos = tok.eos_token_id
    # expected, token by token: the template's segments tokenized one by one (the header line and
    # user/system text: 0; each assistant content token and its EOS: 1)
    expected_ids, expected_mask = [], []
    for m in msgs:
        text = f"<|{m['role']}|>\n{m['content']}"
        head = tok(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
        whole = tok(text, add_special_tokens=False)["input_ids"]
        assert whole[:len(head)] == head  # "\n" is its own piece: the content starts a new token
        body = whole[len(head):]
        train = int(m["role"] == "assistant")
        expected_ids += whole + [eos]
        expected_mask += [0] * len(head) + [train] * len(body) + [train]
    assert ids.tolist() == expected_ids
    assert mask.tolist() == expected_mask
    assert tok.decode(ids[mask == 1]) == "7</s>14</s>"


def test_the_loader_puts_the_mask_on_the_labels(fx):
    """Expected, position by position, from the stream layout (the planner's pieces: which document,
    which slice, where) and each conversation's stored mask (mask.npy): the label of input position q
    carries loss iff it is one of its conversation's assistant tokens (the packer's EOS after a
    conversation never is) and the input is not EOS. Covers conversations cut by a row or micro-batch
    boundary (a piece that starts inside its conversation: ``lo > 0``) and each conversation's last token."""
    from data_pipeline.chat import chat_tokenizer, encode_conversation
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import _Packer, build_loader
    from data_pipeline.shards import Dataset, DatasetReader

    cfg = DataConfig(**chat_data_section(fx), valid_documents=0)
    m = 4
    loader = build_loader(cfg, micro_batch_size=m, global_batch_size=m, dp_rank=0, dp_size=1)
    spec = loader._spec
    planner, packer = spec.new_planner(), _Packer(spec)
    ds = Dataset.load(cfg.sources[0].path)
    reader = DatasetReader(ds)
    tok = chat_tokenizer(fx["tokenizer"])
    eos, S = tok.eos_token_id, cfg.seq_length
    continued = crossing = last_tokens = 0
    for u in range(8):
        batch = next(loader)
        a, n = spec.position(spec.first_sequence(u)), m * S + 1
        stream, target = np.full(n, -1, np.int64), np.zeros(n, bool)
        for src, sid, length, lo, hi, out in planner.pieces(a, a + n):
            doc = reader.get(sid).tolist()
            dmask = reader.last_mask
            assert len(doc) == length - 1 and len(dmask) == len(doc)  # the packer appends one EOS
            for j in range(lo, hi):
                stream[out + j - lo] = doc[j] if j < len(doc) else eos
                target[out + j - lo] = bool(dmask[j]) if j < len(doc) else False
            continued += lo > 0
            crossing += (out + hi - lo - 1) // S > out // S  # continues into the next row
            last = out + len(doc) - 1 - lo  # stream position of the conversation's last token
            if lo <= len(doc) - 1 < hi and last < m * S:
                last_tokens += 1
                assert dmask[-1] == 1 and doc[-1] == eos  # the assistant's end-of-turn: a target ...
                assert not target[last + 1]  # ... the packer's EOS after it is not
                lm_flat = batch["loss_mask"].flatten()
                assert lm_flat[last] == 0  # no loss on the label after the conversation's last token
                if last > 0:
                    assert lm_flat[last - 1] == 1  # the end-of-turn token is learnt
        assert (stream >= 0).all()
        assert batch["input_ids"].flatten().tolist() == stream[:-1].tolist()
        assert batch["labels"].flatten().tolist() == stream[1:].tolist()
        want = (stream[:-1] != eos) & target[1:]
        assert batch["loss_mask"].flatten().tolist() == want.astype(np.float32).tolist()
        got_target = packer.micro_batch(u)["target"]
        assert got_target.tolist() == target.tolist()
    assert continued >= 2 and crossing >= 2 and last_tokens >= 4
    assert 0 < batch["loss_mask"].mean() < 0.5  # the prompts and headers carry no loss
    # the conversations' messages are in the dataset exactly as the template renders them
    ids0, mask0 = encode_conversation(tok, fx["conversations"][0]["messages"])
    assert reader.get(0).tolist() == ids0.tolist() and reader.last_mask.tolist() == mask0.tolist()


def _prepare(tmp_path, fx, rows, *extra):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    return subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "-q", "data", "prepare", "--format", "chat",
                           "--input", str(src), "--tokenizer", fx["tokenizer"], "--out", str(tmp_path / "out"),
                           "--workers", "1", "--quiet", *extra], capture_output=True, text=True)


BAD_ROWS = [
    json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}),
    json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
    json.dumps({"messages": [{"role": "user", "content": "7+7? " * 40}, {"role": "assistant", "content": "14"}]}),
    json.dumps({"messages": [{"role": "user", "content": "b"}, {"role": "tool", "content": "c"},
                             {"role": "assistant", "content": "d"}]}),
    "{not json",
    json.dumps({"text": "a document, not a conversation"}),
    json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "2"}]}),
]


@pytest.mark.slow  # fbt data prepare as a subprocess
def test_bad_conversations_are_counted_by_kind_and_refused_under_strict(tmp_path, fx):
    r = _prepare(tmp_path, fx, BAD_ROWS, "--max-tokens", "48")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["num_samples"] == 1
    assert out["bad_rows"] == {"invalid_json": 1, "not_a_conversation": 2, "unknown_role": 2,
                               "no_assistant_turn": 1, "too_long": 1}
    assert out["first_bad_row"]["unknown_role"].endswith("in.jsonl:2")
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["meta"]["bad_rows"]["counts"] == out["bad_rows"]
    assert "7 bad conversations" in r.stderr  # reported, not silently dropped

    r = _prepare(tmp_path, fx, BAD_ROWS, "--max-tokens", "48", "--strict", "--overwrite")  # in.jsonl is rewritten
    assert r.returncode == 2
    assert "in.jsonl:2: bad conversation: unknown_role (--strict)" in r.stderr


def test_a_conversation_of_exactly_max_tokens_is_kept(tmp_path, fx):
    """``--max-tokens N`` keeps conversations of up to N tokens (the template's rendering, counted by the
    tokenizer): one of exactly N is written, under N - 1 it is counted as too long."""
    from data_pipeline.chat import chat_tokenizer, prepare_chat

    short = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    conv = fx["conversations"][0]
    n = len(chat_tokenizer(fx["tokenizer"]).apply_chat_template(conv["messages"], tokenize=True, return_dict=False))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(short) + "\n" + json.dumps(conv) + "\n")
    for max_tokens, written, too_long in [(n, 2, 0), (n - 1, 1, 1)]:
        index = prepare_chat([str(src)], tmp_path / f"out{max_tokens}", fx["tokenizer"], max_tokens=max_tokens,
                             progress=False)
        assert (index["num_samples"], index["meta"]["bad_rows"]["counts"]["too_long"]) == (written, too_long)
        assert index["num_shards"] == 1  # the default shard size (16 MiB) holds a small dataset in one shard


def test_a_file_with_no_conversation_is_refused_as_such(tmp_path, fx):
    """Plain-text JSONL given to ``--format chat``: the sentence says no row is a conversation, by kind and
    where the first of each is (not "no non-empty documents"), and nothing is written."""
    from data_pipeline.chat import ChatError, prepare_chat

    src = tmp_path / "plain.jsonl"
    src.write_text(json.dumps({"text": "a document"}) + "\n" + "{not json\n")
    with pytest.raises(ChatError) as e:
        prepare_chat([str(src)], tmp_path / "out", fx["tokenizer"], progress=False)
    assert str(e.value) == (f"no row of {src} can be used (not JSON: 1, the first at {src}:2; not a conversation: "
                            f"1, the first at {src}:1); each line must hold "
                            '{"messages": [{"role": ..., "content": ...}, ...]} with an assistant turn: nothing '
                            "was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.jsonl"]
    long = tmp_path / "long.jsonl"  # well-formed, every one over --max-tokens: the fix is the flag
    long.write_text("".join(json.dumps(c) + "\n" for c in fx["conversations"][:3]))
    with pytest.raises(ChatError) as e:
        prepare_chat([str(long)], tmp_path / "out", fx["tokenizer"], max_tokens=4, progress=False)
    assert str(e.value) == (f"no row of {long} can be used (longer than --max-tokens 4: 3, the first at {long}:1); "
                            "raise --max-tokens: nothing was written")


def test_sources_with_different_chat_templates_are_refused_by_name(tmp_path, fx):
    """One run has one chat template (it ships with the checkpoints and the export): a mix of chat
    datasets prepared with different templates is refused, naming the sources, before SFT runs."""
    from data_pipeline.chat import DEFAULT_CHAT_TEMPLATE, ChatError, prepare_chat, sources_chat_template
    from data_pipeline.config import DataConfig
    from fbt_megatron.recipe import RecipeError, load_recipe
    from tests.support.training import resolved_recipe as resolve
    from tests.support.chat_helpers import sft_recipe

    other = DEFAULT_CHAT_TEMPLATE.replace("<|", "<<|")
    assert other != DEFAULT_CHAT_TEMPLATE
    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in fx["conversations"][:4]))
    prepare_chat([str(src)], tmp_path / "other", fx["tokenizer"], chat_template=other, max_tokens=96, progress=False)
    prepare_chat([str(src)], tmp_path / "same", fx["tokenizer"], max_tokens=96, progress=False)
    section = chat_data_section(fx)
    chat = section["sources"][0]
    section["sources"] = [chat, {"name": "other", "path": str(tmp_path / "other"), "weight": 1.0}]
    with pytest.raises(ChatError, match=r"sources \['chat', 'other'\] hold different chat templates"):
        sources_chat_template(DataConfig(**section), require=False)
    r = sft_recipe(tmp_path / "run", fx)
    r["data"]["pipeline"] = section
    with pytest.raises(RecipeError, match="different chat templates"):
        resolve(load_recipe(data=r), "sft")
    section["sources"] = [chat, {"name": "same", "path": str(tmp_path / "same"), "weight": 1.0}]
    assert sources_chat_template(DataConfig(**section), require=True) == DEFAULT_CHAT_TEMPLATE


def test_prompt_ids_are_the_conversation_up_to_the_assistants_answer(fx):
    """What a chat model continues (``prompt_ids``: the messages and the assistant header) is the
    conversation's tokens up to the first token of the assistant's answer, where the loss mask starts."""
    from data_pipeline.chat import chat_tokenizer, encode_conversation, prompt_ids

    tok = chat_tokenizer(fx["tokenizer"])
    for conv in fx["conversations"][:5]:
        messages = conv["messages"]
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = prompt_ids(tok, messages[:first_answer])
        ids, mask = encode_conversation(tok, messages)
        assert prompt == ids[: len(prompt)].tolist()
        assert not mask[: len(prompt)].any() and mask[len(prompt)] == 1


def test_the_chat_tokenizer_names_the_sentencepiece_special_tokens(fx):
    """The fast tokenizer the chat data is rendered with (and that `fbt convert to-hf` saves) names the
    sentencepiece model's UNK, BOS and EOS pieces with their ids (UNK is id 0 in a default model)."""
    import sentencepiece as spm

    from data_pipeline.chat import chat_tokenizer

    sp = spm.SentencePieceProcessor(model_file=fx["tokenizer"])
    tok = chat_tokenizer(fx["tokenizer"])
    assert sp.unk_id() == 0  # the case an id test must cover
    for kind in ("unk", "bos", "eos"):
        sid = getattr(sp, f"{kind}_id")()
        assert getattr(tok, f"{kind}_token") == sp.id_to_piece(sid), kind
        assert getattr(tok, f"{kind}_token_id") == sid, kind


def test_the_chat_tokenizer_names_a_hugging_face_tokenizers_bos_and_eos(tmp_path):
    """With a tokenizer.json the chat tokenizer names that tokenizer's BOS and EOS (a template may render
    ``bos_token``), with their ids."""
    from data_pipeline.chat import chat_tokenizer
    from data_pipeline.tokenizer import load_tokenizer
    from tests.support.data_fixtures import train_hf_bpe

    tok_dir = train_hf_bpe(["one two three four"] * 20, tmp_path / "tok", vocab_size=300)
    hf = load_tokenizer(tok_dir)
    tok = chat_tokenizer(hf)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")  # the fixture's specials
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_id(), hf.eos_id())


def test_a_sentencepiece_model_without_bos_renders_chat(tmp_path):
    """A sentencepiece model trained without a BOS piece (bos_id -1; the data pipeline adds none) gives
    a chat tokenizer with no BOS token, and conversations render with it."""
    import io

    import sentencepiece as spm

    from data_pipeline.chat import chat_tokenizer, encode_conversation

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["user assistant system hello world 1+1=2"] * 50),
                                   model_writer=buf, vocab_size=40, bos_id=-1, hard_vocab_limit=False,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert sp.bos_id() == -1
    tok = chat_tokenizer(buf.getvalue())
    assert tok.bos_token is None and tok.eos_token_id == sp.eos_id()
    ids, mask = encode_conversation(tok, [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}])
    assert ids[-1] == sp.eos_id() and mask[-1] == 1 and mask[0] == 0


def test_iter_conversations_reads_past_blank_lines_and_counts_bad_rows_from_zero(tmp_path, fx):
    """The JSONL reader: blank lines are passed over (the rows after them are read); called on its own
    with an empty ``bad`` it counts each kind of bad row from zero and names the first of each."""
    from data_pipeline.chat import BAD_KINDS, chat_tokenizer, iter_conversations

    good = fx["conversations"][:2]
    src = tmp_path / "gaps.jsonl"
    src.write_text(json.dumps(good[0]) + "\n\n   \n" + "{not json\n" + "\n" + json.dumps(good[1]) + "\n")
    bad: dict = {}
    got = list(iter_conversations([str(src)], chat_tokenizer(fx["tokenizer"]), max_tokens=4096, bad=bad))
    assert len(got) == 2 and got[1][0] == f"{src.name}:6"
    assert bad["counts"] == dict({k: 0 for k in BAD_KINDS}, invalid_json=1)
    assert bad["first"] == {"invalid_json": f"{src}:4"}


def test_prepare_chat_reports_its_progress_unless_told_not_to(tmp_path, fx, capsys):
    """Like `fbt data prepare`, the library call shows its progress and summary on stderr by default;
    ``progress=False`` keeps it quiet."""
    from data_pipeline.chat import prepare_chat

    src = tmp_path / "few.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in fx["conversations"][:3]))
    capsys.readouterr()
    prepare_chat([str(src)], tmp_path / "loud", fx["tokenizer"], max_tokens=96)
    assert "prepare loud: 3 documents" in capsys.readouterr().err
    prepare_chat([str(src)], tmp_path / "quiet", fx["tokenizer"], max_tokens=96, progress=False)
    assert capsys.readouterr().err == ""


def test_chat_messages_put_the_system_prompt_first_when_given():
    """What `fbt generate --chat [--system S]` renders: the system message (if any), then the user's."""
    from data_pipeline.chat import chat_messages

    assert chat_messages("2+2?") == [{"role": "user", "content": "2+2?"}]
    assert chat_messages("2+2?", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "2+2?"}]


def test_rows_without_a_list_of_messages_are_not_conversations():
    from data_pipeline.chat import bad_kind

    for row in [{"messages": []}, {"messages": "hi"}, {"text": "a document"}, ["a", "list"], {"messages": [1]}]:
        assert bad_kind(row) == "not_a_conversation", row
    assert bad_kind({"messages": [{"role": "user", "content": "hi"}]}) == "no_assistant_turn"
    assert bad_kind({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) is None


def test_a_chat_dataset_without_its_template_is_refused_by_name(tmp_path, fx):
    import shutil

    from data_pipeline.chat import ChatError, sources_chat_template
    from data_pipeline.config import DataConfig

    broken = tmp_path / "chat_no_template"
    shutil.copytree(fx["root"] / "chat", broken)
    index = json.loads((broken / "index.json").read_text())
    del index["meta"]["chat_template"]
    (broken / "index.json").write_text(json.dumps(index))
    section = chat_data_section(fx)
    section["sources"] = [{"name": "chat", "path": str(fx["root"] / "chat"), "weight": 1.0},
                          {"name": "broken_chat", "path": str(broken), "weight": 1.0}]
    with pytest.raises(ChatError, match=r"source 'broken_chat' .* is a chat dataset without a chat template"):
        sources_chat_template(DataConfig(**section), require=False)
    # samples that carry a loss mask make a chat dataset, whatever meta.format says
    del index["meta"]["format"]
    (broken / "index.json").write_text(json.dumps(index))
    with pytest.raises(ChatError, match=r"source 'broken_chat' .* is a chat dataset without a chat template"):
        sources_chat_template(DataConfig(**section), require=False)
    # an index that cannot be read is named, not a bare OSError
    from data_pipeline.chat import dataset_chat_template

    with pytest.raises(ChatError, match=rf"source 'gone': cannot read {tmp_path / 'gone' / 'index.json'}"):
        dataset_chat_template(tmp_path / "gone", "gone")
    section["sources"] = [{"name": "plain", "path": str(fx["root"] / "text"), "weight": 1.0}]
    with pytest.raises(ChatError, match=r"source 'plain' .* is not a chat dataset"):
        sources_chat_template(DataConfig(**section), require=True)
    # a pretraining mix (not SFT) of plain text and chat data: the chat source's template, whatever the order
    section["sources"].append({"name": "chat", "path": str(fx["root"] / "chat"), "weight": 1.0})
    assert sources_chat_template(DataConfig(**section), require=False) == fx["template"]
    assert sources_chat_template(DataConfig(**chat_data_section(fx)), require=True) == fx["template"]


def test_packed_conversations_never_attend_to_each_other(fx, single_process):
    """A packed row's conversations give the same logits as each conversation alone."""
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import build_loader
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=512,
                                    max_sequence_length=128), FeedbackConfig()).eval()
    cfg = DataConfig(**chat_data_section(fx, seq_length=128), valid_documents=0)
    b = next(build_loader(cfg, micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1))
    ids, starts = b["input_ids"], b["doc_start"]
    bounds = starts[0].nonzero().flatten().tolist() + [ids.shape[1]]
    assert len(bounds) >= 4  # at least three conversations start in the row
    with torch.no_grad():
        packed = model(input_ids=ids, doc_start=starts, num_passes=2).logits
        for a, z in zip(bounds[1:-1], bounds[2:]):  # whole conversations (the first may be cut)
            alone_starts = torch.zeros(1, z - a, dtype=torch.bool)
            alone_starts[0, 0] = True
            alone = model(input_ids=ids[:, a:z], doc_start=alone_starts, num_passes=2).logits
            torch.testing.assert_close(packed[:, a:z], alone, rtol=1e-4, atol=1e-4)


def test_chat_data_with_a_hugging_face_tokenizer(tmp_path):
    """--format chat with a tokenizer.json: rendered by transformers on that tokenizer.json itself (the ids a
    stock PreTrainedTokenizerFast gives), EOS as one token ending each turn, the loss mask on the assistant
    turns; the index names that tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from data_pipeline.chat import DEFAULT_CHAT_TEMPLATE, prepare_chat
    from data_pipeline.shards import Dataset, DatasetReader
    from data_pipeline.tokenizer import tokenizer_hash
    from tests.support.data_fixtures import train_hf_bpe

    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"},
              {"role": "assistant", "content": "7"}, {"role": "user", "content": "and x2?"},
              {"role": "assistant", "content": "14"}],
             [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Rhine."}]]
    tok_dir = train_hf_bpe([m["content"] for c in convs for m in c] * 20 + ["<|user|> <|assistant|> <|system|>"],
                           tmp_path / "tok", vocab_size=300)
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs) + '{"messages": []}\n')
    idx = prepare_chat([str(src)], tmp_path / "out", tok_dir, shard_bytes=1 << 20, progress=False)
    assert idx["num_samples"] == 2 and idx["meta"]["bad_rows"]["counts"]["not_a_conversation"] == 1
    assert idx["tokenizer_hash"] == tokenizer_hash(tok_dir)

    stock = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="<|end_of_text|>")
    stock.chat_template = DEFAULT_CHAT_TEMPLATE
    eos = stock.convert_tokens_to_ids("<|end_of_text|>")
    reader = DatasetReader(Dataset.load(tmp_path / "out"))
    for sid, conv in enumerate(convs):
        ids = reader.get(sid)
        mask = reader.last_mask
        want = stock.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(want["input_ids"]) and mask.tolist() == list(want["assistant_masks"])
        assert ids.tolist().count(eos) == len(conv)  # one EOS token per turn
        answers = "".join(m["content"] + "<|end_of_text|>" for m in conv if m["role"] == "assistant")
        assert stock.decode(ids[mask == 1]) == answers
