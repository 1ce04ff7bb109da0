"""Chat data: input formats, assistant-only loss masks (multi-turn, thinking templates), bad records, buckets,
deterministic and resumable order, sharded batches."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import train_fixtures as tf
from real_model import smollm2_path
from specjax.sharding import make_mesh
from specjax.train import data as D
from specjax.train.config import DataConfig


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tf.make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    return tf.make_tokenizer(str(tmp_path_factory.mktemp("tok_think")), template=tf.THINKING)


CONV = [{"from": "system", "value": "be brief"},
        {"from": "human", "value": "what is the sky"},
        {"from": "gpt", "value": "blue sky one two"},
        {"from": "human", "value": "and the sea"},
        {"from": "gpt", "value": "green sea three"},
        {"from": "human", "value": "thanks"},
        {"from": "gpt", "value": "yes happy"}]


def _expected(tok, segments):
    """Independent oracle: tokenize each (text, is_target) segment on its own (the tiny BPE never merges across
    these boundaries) and concatenate."""
    ids, mask = [], []
    for text, target in segments:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [int(target)] * len(t)
    return np.asarray(ids), np.asarray(mask)


def test_multiturn_mask_exact(tok):
    enc = D.ChatEncoder(tok)
    ids, mask = enc.encode(D.to_messages({"conversations": CONV}))
    segs = [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is the sky<|im_end|>\n"
             "<|im_start|>assistant\n", 0), ("blue sky one two<|im_end|>", 1),
            ("\n<|im_start|>user\nand the sea<|im_end|>\n<|im_start|>assistant\n", 0), ("green sea three<|im_end|>", 1),
            ("\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n", 0), ("yes happy<|im_end|>", 1), ("\n", 0)]
    want_ids, want_mask = _expected(tok, segs)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    assert tok.decode(ids[mask == 1]) == "blue sky one two<|im_end|>green sea three<|im_end|>yes happy<|im_end|>"


def test_a_truncated_answer_teaches_no_end_of_turn(tok):
    """An answer that ran out of its token budget (``regenerate`` marks it ``truncated``) keeps its tokens in the
    loss but not the template's end-of-turn after them: the target never wrote one there."""
    enc = D.ChatEncoder(tok)
    conv = [dict(t) for t in CONV[:5]]
    conv[4]["truncated"] = True  # "green sea three": cut off
    msgs = D.to_messages({"conversations": conv})
    assert msgs[-1] == {"role": "assistant", "content": "green sea three", "truncated": True}
    ids, mask = enc.encode(msgs)
    segs = [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is the sky<|im_end|>\n"
             "<|im_start|>assistant\n", 0), ("blue sky one two<|im_end|>", 1),
            ("\n<|im_start|>user\nand the sea<|im_end|>\n<|im_start|>assistant\n", 0), ("green sea three", 1),
            ("<|im_end|>\n", 0)]
    want_ids, want_mask = _expected(tok, segs)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    # the flag means True only, and only on an assistant turn
    conv[4]["truncated"] = "yes"
    assert "truncated" not in D.to_messages({"conversations": conv})[-1]


# Qwen3's way: an assistant turn's reasoning_content rendered in a thinking block before its content
REASONING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}"
             "\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# a Qwen2.5-style tool template: the tools in a system block, calls inside the assistant turn, answers as user turns
TOOLS = ("{% if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
         "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<r>"
         "{{ m['content'] }}</r><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
         "{% for c in m.get('tool_calls') or [] %}<c>{{ c['function']['name'] }} "
         "{{ c['function']['arguments'] | tojson }}</c>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% endif %}")


def test_tool_calling_conversations_are_learnt(tmp_path):
    """SpecForge's tool data: a ``tool`` role, an assistant turn's ``tool_calls`` (arguments as a JSON string too) and
    a record's ``tools`` reach the chat template; the calls are learnt with their turn, the tools' answers are not
    (these conversations were dropped as wrong_role)."""
    ttok = tf.make_tokenizer(str(tmp_path / "tok"), template=TOOLS)
    call = {"id": "c1", "type": "function", "function": {"name": "sky", "arguments": '{"x": 1}'}}
    rec = {"messages": [{"role": "user", "content": "what is the sky"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "blue"},
                        {"role": "assistant", "content": "the sky is blue"}],
           "tools": '[{"type": "function", "function": {"name": "sky"}}]'}
    msgs = D.to_messages(rec)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "sky", "arguments": {"x": 1}}
    ids, mask = D.ChatEncoder(ttok).encode(msgs, D.record_tools(rec))
    text = ttok.decode(ids)
    assert text.startswith("<|im_start|>system\ntools: sky <|im_end|>") and "<r>blue</r>" in text
    assert ttok.decode(ids[mask == 1]) == '<c>sky {"x": 1}</c><|im_end|>the sky is blue<|im_end|>'
    for bad, reason in (({"tool_calls": "{oops"}, "bad_format"), ({"tool_calls": [{"function": {}}]}, "bad_format")):
        broken = dict(rec, messages=[rec["messages"][0], dict(rec["messages"][1], **bad), *rec["messages"][2:]])
        with pytest.raises(D.BadRecord) as e:
            D.to_messages(broken)
        assert e.value.reason == reason
    with pytest.raises(D.BadRecord, match="tool turns are not regenerated"):
        D.to_messages(rec, prompts=True)
    with pytest.raises(D.BadRecord, match="a tool turn after a user turn"):
        D.to_messages({"messages": [rec["messages"][0], rec["messages"][2], rec["messages"][3]]})


def test_reasoning_content_is_rendered_and_learnt(tmp_path):
    """An assistant turn's ``reasoning_content`` (SpecForge's regenerated thinking data) reaches the chat template,
    and its thinking block is in the loss with the answer (it was dropped silently)."""
    rtok = tf.make_tokenizer(str(tmp_path / "tok"), template=REASONING)
    rec = {"messages": [{"role": "user", "content": "what is the sky"},
                        {"role": "assistant", "content": "blue", "reasoning_content": "the sky is blue"}]}
    msgs = D.to_messages(rec)
    assert msgs[-1]["reasoning_content"] == "the sky is blue"
    ids, mask = D.ChatEncoder(rtok).encode(msgs)
    assert rtok.decode(ids[mask == 1]) == "<think>\nthe sky is blue\n</think>\n\nblue<|im_end|>"


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_template(think_tok, thinking):
    """Qwen3-style: history turns render without a thinking block, the last turn with one. With thinking off the
    generation prompt injects the empty block, so it is context, not a target."""
    enc = D.ChatEncoder(think_tok, {} if thinking else {"enable_thinking": False})
    msgs = D.to_messages({"conversations": CONV[1:5]})
    ids, mask = enc.encode(msgs)
    think = "<think>\n\n</think>\n\n"
    segs = [("<|im_start|>user\nwhat is the sky<|im_end|>\n<|im_start|>assistant\n", 0),
            ("blue sky one two<|im_end|>", 1),
            ("\n<|im_start|>user\nand the sea<|im_end|>\n<|im_start|>assistant\n", 0), (think, int(thinking)),
            ("green sea three<|im_end|>", 1), ("\n", 0)]
    want_ids, want_mask = _expected(think_tok, segs)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)


def test_smollm2_tokenizer_mask():
    path = smollm2_path()
    tok = D.load_tokenizer(path)
    enc = D.ChatEncoder(tok)
    ids, mask = enc.encode(D.to_messages({"conversations": CONV}))
    assert tok.decode(ids[mask == 1]) == "blue sky one two<|im_end|>green sea three<|im_end|>yes happy<|im_end|>"
    assert tok.decode(ids) == tok.apply_chat_template(D.to_messages({"conversations": CONV}), tokenize=False)


def _write_sources(d, convs):
    """The same conversations as ShareGPT JSON (cut off mid-way), ShareGPT JSONL, messages JSONL, parquet and a
    datasets.save_to_disk folder."""
    import datasets
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    msgs = [{"messages": [{"role": role[t["from"]], "content": t["value"]} for t in c["conversations"]]}
            for c in convs]
    text = json.dumps(convs, indent=1)
    cut = text + "\n"  # append a truncated extra item, like the real ShareGPT file
    cut = text[:-1].rstrip() + ', {"id": "x", "conversations": [{"from": "human", "va'
    paths = {"sharegpt_json": str(d / "sg.json"), "sharegpt_jsonl": str(d / "sg.jsonl"),
             "messages_jsonl": str(d / "msgs.jsonl"), "parquet": str(d / "msgs.parquet"), "disk": str(d / "ds")}
    open(paths["sharegpt_json"], "w").write(cut)
    tf.write_jsonl(paths["sharegpt_jsonl"], convs)
    tf.write_jsonl(paths["messages_jsonl"], msgs)
    ds = datasets.Dataset.from_list(msgs)
    ds.to_parquet(paths["parquet"])
    datasets.Dataset.from_list(convs).save_to_disk(paths["disk"])
    return paths


def test_input_formats_agree(tok, tmp_path):
    convs = tf.make_conversations(12, seed=3)
    paths = _write_sources(tmp_path, convs)
    enc = D.ChatEncoder(tok)
    results = {}
    for name, p in paths.items():
        cfg = DataConfig(paths=(p,), max_length=4096)
        results[name] = D.tokenize_records(D.iter_records(cfg), enc, max_length=4096)
    ref = results["sharegpt_jsonl"]
    assert ref.stats["kept"] == 12 and len(ref) == 12
    for name, r in results.items():
        assert r.stats["kept"] == 12, (name, r.stats)
        np.testing.assert_array_equal(r.tokens, ref.tokens)
        np.testing.assert_array_equal(r.loss_mask, ref.loss_mask)
        np.testing.assert_array_equal(r.offsets, ref.offsets)
    # load_dataset caches the tokenized data and reads it back identically
    cfg = DataConfig(paths=(paths["sharegpt_jsonl"], paths["messages_jsonl"]), max_length=4096,
                     cache_dir=str(tmp_path / "cache"))
    a = D.load_dataset(cfg, tok, log=lambda s: None)
    b = D.load_dataset(cfg, tok, log=lambda s: None)
    assert len(os.listdir(tmp_path / "cache")) == 1 and len(a) == 24
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_the_cache_follows_what_a_folder_holds(tok, tmp_path):
    """A datasets.save_to_disk folder saved again with other conversations is read again, not taken from the
    tokenized cache (rewriting the files inside leaves the folder's own size and time as they were)."""
    import datasets
    folder, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    cfg = DataConfig(paths=(folder,), max_length=4096, cache_dir=cache)
    datasets.Dataset.from_list(tf.make_conversations(4, seed=1)).save_to_disk(folder)
    a = D.load_dataset(cfg, tok, log=lambda s: None)
    datasets.Dataset.from_list(tf.make_conversations(4, seed=2)).save_to_disk(folder + ".new")
    shutil.rmtree(folder)
    os.rename(folder + ".new", folder)
    b = D.load_dataset(cfg, tok, log=lambda s: None)
    assert len(os.listdir(cache)) == 2 and not np.array_equal(a.tokens, b.tokens)


def test_mixed_tables_and_one_json_object(tok, tmp_path):
    """A parquet table mixing preformatted text rows and turns (each row gets every column, None where it has
    none) keeps both kinds; a .json file holding one pretty-printed object is refused in one line."""
    import datasets
    conv, enc = tf.make_conversations(1, seed=4)[0], D.ChatEncoder(tok)
    datasets.Dataset.from_dict({"conversations": [conv["conversations"], None],
                                "text": [None, enc.render(D.to_messages(conv), False)]}).to_parquet(
        str(tmp_path / "mixed.parquet"))
    out = D.tokenize_records(D.iter_records(DataConfig(paths=(str(tmp_path / "mixed.parquet"),))), enc,
                             max_length=4096)
    assert out.stats["kept"] == 2, out.stats
    np.testing.assert_array_equal(out.tokens[out.offsets[0]:out.offsets[1]], out.tokens[out.offsets[1]:])
    for body, hint in (({"data": [conv]}, "its records look to be under 'data'"), (conv, "one record over several lines")):
        (tmp_path / "one.json").write_text(json.dumps(body, indent=2))
        with pytest.raises(D.NoUsableData, match=f"one JSON object \\({hint}"):
            list(D.iter_records(DataConfig(paths=(str(tmp_path / "one.json"),))))


def test_bad_records_counted(tok, tmp_path):
    good = tf.make_conversations(3, seed=1)
    p = tmp_path / "bad.jsonl"
    with open(p, "wb") as f:
        for r in good:
            f.write((json.dumps(r) + "\n").encode())
        f.write(b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "val\n')  # broken json
        f.write(b'\xff\xfe not utf8\n')  # undecodable
        f.write(b'{"conversations": []}\n')  # empty
        f.write(b'{"conversations": [{"from": "human", "value": "hi"}]}\n')  # no assistant turn
        f.write(b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}\n')  # empty
        f.write(b'{"conversations": [{"from": "alien", "value": "hi"}]}\n')  # wrong role
        f.write(b'{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, '
                b'{"from": "gpt", "value": "c"}]}\n')  # two user turns in a row
        f.write(b'{"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]}\n')
        f.write(b'{"text": "no conversation here"}\n')
        f.write(b'[1, 2]\n')
        f.write(b'{"conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "x"}]}\n')
        f.write((json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                               {"from": "gpt", "value": "cat " * 300}]}) + "\n").encode())
    enc = D.ChatEncoder(tok)
    cfg = DataConfig(paths=(str(p),))
    out = D.tokenize_records(D.iter_records(cfg), enc, max_length=256, overlong="drop")
    # (the `text` record is read as preformatted text, data.format auto, and holds no assistant turn)
    assert out.stats == {"records": 15, "kept": 3, "undecodable": 3, "empty": 3, "wrong_role": 2,
                         "bad_format": 2, "no_assistant_tokens": 1, "too_long": 1}, out.stats
    assert "kept 3 of 15" in D.summary(out.stats)
    out = D.tokenize_records(D.iter_records(cfg), enc, max_length=256, overlong="truncate")
    assert out.stats["kept"] == 4 and out.stats["truncated"] == 1 and out.lengths.max() == 256
    # a conversation truncated before its first assistant token has nothing to learn from
    out = D.tokenize_records(D.iter_records(cfg), enc, max_length=8, overlong="truncate")
    assert out.stats["kept"] == 0 and out.stats["no_assistant_tokens"] == 5


# Llama 3's layout (a BOS, headers ending in a blank line, no newline after the end token)
LLAMA3ISH = ("<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}</think>\n\n{{ m['content'] }}<|im_end|>"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant</think>\n\n{% endif %}")
# gpt-oss's: the final answer ends with another token (<|return|> there) than answers in the history (<|end|>)
LASTENDS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if m['role'] == 'assistant' and loop.last %}<|endoftext|>{% else %}<|im_end|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Phi-3's: a conversation without a generation prompt ends with EOS
EOSEND = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}")


@pytest.mark.parametrize("template", ["chatml", "thinking", "thinking-off", "llama3ish", "lastends"])
def test_preformatted_text_reads_as_its_conversation(tok, think_tok, tmp_path, template):
    """SpecForge's --is-preformatted data (`text`: a conversation already rendered with the target's chat template)
    gives the tokens and loss mask of the same conversation given as turns, in both data.format auto and text."""
    t = {"chatml": tok, "thinking": think_tok, "thinking-off": think_tok}.get(template)
    if t is None:
        t = tf.make_tokenizer(str(tmp_path / "tok"), template=LLAMA3ISH if template == "llama3ish" else LASTENDS)
    enc = D.ChatEncoder(t, {"enable_thinking": False} if template == "thinking-off" else {})
    convs = tf.make_conversations(8, seed=5) + [{"conversations": CONV}]
    texts = [{"text": enc.render(D.to_messages(c), False)} for c in convs]
    tf.write_jsonl(str(tmp_path / "turns.jsonl"), convs)
    tf.write_jsonl(str(tmp_path / "text.jsonl"), texts)
    ref = D.tokenize_records(D.iter_records(DataConfig(paths=(str(tmp_path / "turns.jsonl"),))), enc, max_length=4096)
    for fmt in ("auto", "text"):
        got = D.tokenize_records(D.iter_records(DataConfig(paths=(str(tmp_path / "text.jsonl"),))), enc,
                                 max_length=4096, fmt=fmt)
        assert got.stats == ref.stats == {"records": 9, "kept": 9}
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        np.testing.assert_array_equal(got.loss_mask, ref.loss_mask)
        np.testing.assert_array_equal(got.offsets, ref.offsets)


def test_preformatted_text_spans(tok, tmp_path):
    """An answer cut short (no end-of-turn) is learnt to the end of the text; headers and end markers can be given
    for text in another layout; records of the wrong shape are counted, not read."""
    enc = D.ChatEncoder(tok)
    assert (enc.assistant_header, enc.end_marker) == ("<|im_start|>assistant\n", "<|im_end|>")
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nblue sky<|im_end|>\n<|im_start|>assistant\ngreen se"
    ids, mask = enc.encode_rendered([enc.text_spans(text)])[0]
    assert tok.decode(ids[mask == 1]) == "blue sky<|im_end|>green se"
    phi = D.ChatEncoder(tf.make_tokenizer(str(tmp_path / "phi"), template=EOSEND))  # the header after a user turn
    assert (phi.assistant_header, phi.turn_end) == ("<|im_start|>assistant\n", "<|im_end|>")
    bare = tf.make_tokenizer(str(tmp_path / "bare"))
    bare.chat_template = None
    with pytest.raises(D.NoUsableData, match="no chat template"):
        D.ChatEncoder(bare)
    own = D.ChatEncoder(bare, assistant_header="A:", end_of_turn="<|im_end|>")  # text needs no template then
    ids, mask = own.encode_rendered([own.text_spans("Q: what is the sky\nA: blue sky<|im_end|>\nQ: and\nA: sea")])[0]
    assert tok.decode(ids[mask == 1]) == " blue sky<|im_end|> sea"
    records = [{"text": 5}, {"text": "  "}, {"text": "\ud800"}, {"conversations": CONV}, {"messages": []}]
    out = D.tokenize_records(iter(records), enc, max_length=512, fmt="text")
    assert out.stats == {"records": 5, "kept": 0, "bad_format": 3, "empty": 1, "undecodable": 1}, out.stats
    with pytest.raises(D.BadRecord, match="preformatted text"):
        D.to_messages({"text": text}, prompts=True)  # regeneration needs turns


def _fake_data(lengths, seed=0):
    rng = np.random.default_rng(seed)
    toks = [rng.integers(1, 100, size=n).astype(np.int32) for n in lengths]
    masks = [(rng.random(n) < 0.5).astype(np.uint8) for n in lengths]
    return D.TokenizedData(np.concatenate(toks), np.concatenate(masks),
                           np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), {})


def test_buckets_and_plan():
    assert D.bucket_sizes((128, 256, 512, 1024), 300) == (128, 256, 300)
    assert D.bucket_sizes((128, 256), 1024) == (128, 256, 1024)
    lengths = np.random.default_rng(0).integers(5, 300, size=103)
    data = _fake_data(lengths)
    sizes = D.bucket_sizes((32, 64, 128, 256), 300)
    plan = D.epoch_plan(data.lengths, sizes, 8, seed=1, epoch=0)
    assert len(plan) == D.steps_per_epoch(data.lengths, sizes, 8)
    seen = np.concatenate([pb.rows[pb.rows >= 0] for pb in plan])
    assert sorted(seen) == list(range(103))  # every conversation exactly once per epoch
    for pb in plan:
        real = pb.rows[pb.rows >= 0]
        assert pb.seq_len in sizes and (data.lengths[real] <= pb.seq_len).all()
        smaller = [s for s in sizes if s < pb.seq_len]
        assert not smaller or (data.lengths[real] > smaller[-1]).all()  # the smallest bucket that fits
    assert {pb.seq_len for pb in plan} <= set(sizes)
    # deterministic per (seed, epoch); epochs differ
    again = D.epoch_plan(data.lengths, sizes, 8, seed=1, epoch=0)
    assert all(a.seq_len == b.seq_len and (a.rows == b.rows).all() for a, b in zip(plan, again))
    other = D.epoch_plan(data.lengths, sizes, 8, seed=1, epoch=1)
    assert any((a.rows != b.rows).any() for a, b in zip(plan, other))


def test_iterator_resume_and_contents():
    lengths = np.random.default_rng(1).integers(5, 60, size=37)
    data = _fake_data(lengths, seed=2)
    kw = dict(batch_size=4, grad_accum=2, buckets=(16, 32), max_length=64, seed=5)
    it = D.BatchIterator(data, **kw)
    n = it.steps_per_epoch
    ref = [next(it) for _ in range(n + 3)]  # crosses into epoch 1
    assert it.state_dict() == {"epoch": 1, "position": 3}
    b, info = ref[0]
    assert b["input_ids"].shape == (2, 4, info["seq_len"]) and b["input_ids"].dtype == np.int32
    # rows hold the examples, padded; masks agree
    pb = D.epoch_plan(data.lengths, it.sizes, 8, 5, 0)[0]
    for k, ex in enumerate(pb.rows):
        a, r = divmod(k, 4)
        if ex < 0:
            assert b["attention_mask"][a, r].sum() == 0
            continue
        t, m = data.example(int(ex))
        np.testing.assert_array_equal(b["input_ids"][a, r, :len(t)], t)
        np.testing.assert_array_equal(b["loss_mask"][a, r, :len(t)], m)
        assert b["attention_mask"][a, r].sum() == len(t) and b["loss_mask"][a, r, len(t):].sum() == 0
    # resume from any saved state gives the same continuation
    for stop in (1, n - 1, n + 1):
        it2 = D.BatchIterator(data, **kw)
        it2.load_state_dict(json.loads(json.dumps(ref_state(kw, data, stop))))
        for want in ref[stop:]:
            got = next(it2)
            for key in want[0]:
                np.testing.assert_array_equal(got[0][key], want[0][key])


def ref_state(kw, data, steps):
    it = D.BatchIterator(data, **kw)
    for _ in range(steps):
        it.peek()
        it.position += 1
    return it.state_dict()


def test_sharded_batches_match():
    lengths = np.random.default_rng(3).integers(5, 60, size=40)
    data = _fake_data(lengths, seed=4)
    mesh = make_mesh(dp=4, tp=4)
    sharding = NamedSharding(mesh, P(None, "dp", None))
    kw = dict(batch_size=8, grad_accum=2, buckets=(32,), max_length=64, seed=0)
    plain, sharded = D.BatchIterator(data, **kw), D.BatchIterator(data, sharding=sharding, **kw)
    for _ in range(3):
        (a, ia), (b, ib) = next(plain), next(sharded)
        assert ia == ib
        for k in a:
            assert isinstance(b[k], jax.Array) and b[k].sharding == sharding
            np.testing.assert_array_equal(np.asarray(b[k]), a[k])
    assert list(D.local_batch_rows(sharding, (2, 8, 32))) == list(range(8))


def test_split_eval():
    data = _fake_data(np.full(50, 10))
    tr, ev = D.split_eval(data, 0.1, 100, seed=0)
    assert len(tr) == 45 and len(ev) == 5
    tr2, ev2 = D.split_eval(data, 0.1, 100, seed=0)
    np.testing.assert_array_equal(ev.tokens, ev2.tokens)
    assert len(D.split_eval(data, 0.5, 3, seed=0)[1]) == 3
    assert len(D.split_eval(data, 0.0, 3, seed=0)[1]) == 0


def test_eval_paths_are_a_held_out_set_of_their_own(tok, tmp_path):
    """data.eval_paths (SpecForge's --eval-data-path, prepare_data's *_test.jsonl): the run trains on all of
    data.paths and evaluates on the first eval_max conversations of the eval files."""
    train_file = tf.write_jsonl(str(tmp_path / "train.jsonl"), tf.make_conversations(12, seed=1))
    eval_file = tf.write_jsonl(str(tmp_path / "test.jsonl"), tf.make_conversations(5, seed=2))
    cfg = DataConfig(paths=(train_file,), eval_paths=(eval_file,), eval_max=3, cache_dir=str(tmp_path / "cache"))
    full = D.load_dataset(cfg, tok, log=lambda m: None)
    tr, ev = D.train_and_eval(cfg, full, tok, seed=0, log=lambda m: None)
    assert len(tr) == len(full) == 12 and len(ev) == 3
    held = D.load_dataset(DataConfig(paths=(eval_file,), cache_dir=str(tmp_path / "cache")), tok, log=lambda m: None)
    np.testing.assert_array_equal(ev.tokens, held.tokens[:held.offsets[3]])
    no_eval = DataConfig(paths=(train_file,), eval_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    assert [len(x) for x in D.train_and_eval(no_eval, full, tok, seed=0)] == [9, 3]


def test_compressed_sources_read(tok, tmp_path):
    import bz2
    import gzip
    import lzma
    convs = tf.make_conversations(6, seed=4)
    jsonl = "".join(json.dumps(c) + "\n" for c in convs).encode()
    files = {"a.jsonl.gz": gzip.compress(jsonl), "b.jsonl.bz2": bz2.compress(jsonl), "c.jsonl.xz": lzma.compress(jsonl),
             "d.json.gz": gzip.compress(json.dumps(convs).encode()), "ref.jsonl": jsonl}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    enc = D.ChatEncoder(tok)
    ref = D.tokenize_records(D.iter_records(DataConfig(paths=(str(tmp_path / "ref.jsonl"),))), enc, max_length=4096)
    for name in files:
        out = D.tokenize_records(D.iter_records(DataConfig(paths=(str(tmp_path / name),))), enc, max_length=4096)
        assert out.stats == {"records": 6, "kept": 6}, (name, out.stats)
        np.testing.assert_array_equal(out.tokens, ref.tokens)


def _records_with_log(path):
    logged = []
    recs = list(D.iter_records(DataConfig(paths=(str(path),)), log=logged.append))
    return recs, logged


def test_damaged_files_lose_no_record_silently(tok, tmp_path):
    """A JSON array cut at two thirds, one garbage item in the middle of an array, a cut-off .jsonl.gz: every record
    is either read or counted with its reason, and the log says where the file stops parsing."""
    import gzip
    convs = tf.make_conversations(12, seed=6)
    text = json.dumps(convs, indent=1)
    (tmp_path / "cut.json").write_text(text[:2 * len(text) // 3])
    recs, logged = _records_with_log(tmp_path / "cut.json")
    good = [r for r in recs if not isinstance(r, D.BadRecord)]
    bad = [r for r in recs if isinstance(r, D.BadRecord)]
    assert good == convs[:len(good)] and 0 < len(good) < 12
    assert [b.reason for b in bad] == ["truncated_file"] and len(logged) == 1
    assert "cut.json" in logged[0] and "line" in logged[0] and "cut off" in logged[0]

    items = [json.dumps(c) for c in convs]
    items[4] = items[4].replace('"conversations"', '"conversations" oops', 1)
    (tmp_path / "garbage.json").write_text("[\n" + ",\n".join(items) + "\n]\n")
    recs, logged = _records_with_log(tmp_path / "garbage.json")
    good = [r for r in recs if not isinstance(r, D.BadRecord)]
    assert good == convs[:4] + convs[5:]  # everything after the garbage item is still read
    assert [r.reason for r in recs if isinstance(r, D.BadRecord)] == ["unparseable"]
    assert "line 6" in logged[0], logged
    enc = D.ChatEncoder(tok)
    out = D.tokenize_records(iter(recs), enc, max_length=4096)
    assert out.stats == {"records": 12, "kept": 11, "unparseable": 1}
    assert "unparseable 1" in D.summary(out.stats)

    data = gzip.compress("".join(json.dumps(c) + "\n" for c in convs).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
    recs, logged = _records_with_log(tmp_path / "cut.jsonl.gz")
    good = [r for r in recs if not isinstance(r, D.BadRecord)]
    assert good == convs[:len(good)] and len(good) < 12
    assert recs[-1].reason == "truncated_file" and "cannot be read past line" in logged[-1]


def test_to_messages_prompts_mode():
    """Training needs an answer (trailing user turns dropped); regeneration needs only the user turns."""
    rec = {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                             {"from": "human", "value": "q2"}]}
    assert [m["content"] for m in D.to_messages(rec)] == ["q1", "a1"]
    assert [m["content"] for m in D.to_messages(rec, prompts=True)] == ["q1", "a1", "q2"]
    only_q = {"conversations": [{"from": "human", "value": "q"}]}
    with pytest.raises(D.BadRecord, match="no assistant turn"):
        D.to_messages(only_q)
    assert D.to_messages(only_q, prompts=True) == [{"role": "user", "content": "q"}]
