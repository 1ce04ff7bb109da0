"""``python -m specjax.train.regenerate`` on the real SmolLM2: each regenerated answer is exactly the target's plain
greedy answer to the same chat (the oracle is ``specjax.generate`` one prompt at a time, not batched), multi-turn
answers see the regenerated history, bad records are counted, and a rerun resumes (also after a torn last line).

Needs the converted model in the cache (``python -m specjax.convert fetch-smollm2``); skips otherwise.
"""

import json

import pytest

from real_model import smollm2_path
from specjax.train import regenerate as regen

NEW = 12
CONVS = [
    {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                  {"from": "gpt", "value": "Paris, of course."},
                                  {"from": "human", "value": "And of Italy?"},
                                  {"from": "gpt", "value": "Rome."}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},  # unusable
    {"id": "c", "messages": [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Blue."}]},
    "not a record",
]


@pytest.fixture(scope="module")
def model_path():
    return smollm2_path()


def _plain_answer(path, messages, new=NEW):
    from specjax.generate import generate, load_tokenizer
    from specjax.weights import load_model, stop_token_ids
    cfg, params = load_model(path)
    tok = load_tokenizer(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = generate(params, cfg, [ids], max_new_tokens=new, stop_token_ids=stop_token_ids(path, cfg, tok))[0]
    return tok.decode(out, skip_special_tokens=True).strip()


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_regenerate_matches_plain_greedy_and_resumes(model_path, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in CONVS) + "\n{broken json\n")
    out = tmp_path / "out.jsonl"
    cfg = regen.RegenConfig(model=model_path, data=[str(src)], out=str(out), max_new_tokens=NEW, batch_size=2,
                            chunk=2, max_turns=2)
    stats = regen.regenerate(cfg, log=lambda m: None)
    assert stats["written"] == 2
    assert stats["empty"] == 1 and stats["bad_format"] == 1 and stats["undecodable"] == 1
    recs = {r["id"]: r for r in _read(out)}
    a, c = recs["a"]["messages"], recs["c"]["messages"]
    assert [m["role"] for m in a] == ["user", "assistant", "user", "assistant"]
    assert a[0]["content"] == "What is the capital of France?" and a[2]["content"] == "And of Italy?"
    # the oracle: plain greedy on the regenerated history, one conversation at a time
    assert a[1]["content"] == _plain_answer(model_path, a[:1])
    assert a[3]["content"] == _plain_answer(model_path, a[:3])
    assert a[1]["content"] != "Paris, of course."
    assert [m["role"] for m in c] == ["system", "user", "assistant"]
    assert c[2]["content"] == _plain_answer(model_path, c[:2])

    # resume: a torn last line is dropped and rewritten; finished records are skipped, not duplicated
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    stats = regen.regenerate(cfg, log=lambda m: None)
    assert stats["already_done"] == 1 and stats["written"] == 1
    again = _read(out)
    assert sorted(r["id"] for r in again) == ["a", "c"]
    assert {r["id"]: r for r in again} == recs


def test_an_answer_cut_at_its_budget_is_marked_and_ends_the_conversation(model_path, tmp_path):
    """An answer that ran out of max_new_tokens before the target's stop token is kept, marked ``truncated`` (the
    trainer then learns no end of turn after it), and no later turn is answered after it."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "d", "conversations": [
        {"from": "human", "value": "Write a long story about a dragon who learns to bake bread."},
        {"from": "gpt", "value": "Once upon a time..."}, {"from": "human", "value": "Make it longer."}]}) + "\n")
    out = tmp_path / "out.jsonl"
    cfg = regen.RegenConfig(model=model_path, data=[str(src)], out=str(out), max_new_tokens=4, max_turns=2)
    stats = regen.regenerate(cfg, log=lambda m: None)
    assert stats["written"] == 1 and stats["answers_cut_at_max_new_tokens"] == 1
    (rec,) = _read(out)
    d = rec["messages"]
    assert [m["role"] for m in d] == ["user", "assistant"] and d[1]["truncated"] is True
    assert d[1]["content"] == _plain_answer(model_path, d[:1], new=4)


def test_regenerate_cli_rejects_bad_values(capsys):
    assert regen.main(["--model", "x", "--out", "y", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err


def test_first_conversation_selects_a_slice(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                                                     {"from": "gpt", "value": "a"}]})
                             for i in range(6)) + "\n")
    cfg = regen.RegenConfig(model="unused", data=[str(src)], out="unused", first_conversation=2, max_conversations=3)
    convs = list(regen.iter_conversations(cfg, {3}, regen.collections.Counter()))
    assert [c.source_index for c in convs] == [2, 4]  # records 2..4, minus the one already written
    assert regen.main(["--model", "x", "--out", "y", "--first-conversation", "-1"]) == 2


def test_prompt_only_records_are_regenerated(tmp_path):
    """A prompts file (user turns, no answers: what a user brings to regenerate) is read, not counted as empty;
    a record with no user text still is."""
    src = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "first?"}]},
            {"id": "b", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                     {"role": "assistant", "content": "old"}, {"role": "user", "content": "q2"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "  "}]}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = regen.RegenConfig(model="unused", data=[str(src)], out="unused")
    stats = regen.collections.Counter()
    convs = list(regen.iter_conversations(cfg, set(), stats))
    assert [c.id for c in convs] == ["a", "b"]
    assert [m["content"] for m in convs[1].users] == ["be brief", "q1", "q2"]
    assert stats == {"empty": 1}


def test_nothing_usable_is_an_error_before_the_model_loads(tmp_path, capsys):
    """An empty file, records without messages, a --first-conversation past the end: exit 2 with the counts (was
    "wrote 0 conversations" and exit 0, after loading the model; "x" is no model). All of the slice already written
    is no error: the rerun of a finished run."""
    src = tmp_path / "in.jsonl"
    argv = ["--model", "x", "--out", str(tmp_path / "out.jsonl"), "--data", str(src)]
    for text, said in (("", "(counts: no records)"), ('{"id": 1}\n{"text": "hi"}\n', "(counts: bad_format 2)")):
        src.write_text(text)
        assert regen.main(argv) == 2
        assert capsys.readouterr().err.strip() == f"error: no usable conversations in {src} {said}"
    src.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]})
                             for i in range(3)) + "\n")
    assert regen.main(argv + ["--first-conversation", "5"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: no usable conversations in {src} (counts: "
                                               f"before_first_conversation 3); --first-conversation 5 is past its 3 "
                                               f"records")
    cfg = regen.RegenConfig(model="x", data=[str(src)], out="unused")
    stats = regen.collections.Counter()
    assert list(regen.usable_conversations(cfg, {0, 1, 2}, stats)) == [] and stats == {"already_done": 3}
    assert [c.source_index for c in regen.usable_conversations(cfg, {1}, stats)] == [0, 2]
