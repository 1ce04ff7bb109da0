"""Logprobs and penalties through the HTTP API of a live server (tiny random Llama, CPU): SGLang's native
``return_logprob`` layout, OpenAI chat ``logprobs``/``top_logprobs`` and completions ``logprobs``/``echo`` read by
the official ``openai`` client, values equal to HF transformers' log_softmax, and penalties / logit_bias /
min_new_tokens equal to the offline plain decoder with the same typed rows."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from specjax import sampling
from server_helpers import SHARED_NAME, model_dir, server  # noqa: F401 (fixtures)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids):
    """f64[len(ids), V] log_softmax of HF's logits after each token."""
    import torch
    with torch.no_grad():
        logits = hf[1](torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def gen(server, **body):
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_native_logprob_layout_matches_hf(server, hf):
    tok = hf[0]
    ids = tok(PROMPT)["input_ids"]
    out = gen(server, input_ids=ids, return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
              return_text_in_logprobs=True, sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                             "ignore_eos": True})
    meta, oids = out["meta_info"], out["output_ids"]
    ref = hf_logprobs(hf, ids + oids)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None  # (logprob, token_id, text); the first has no context
    np.testing.assert_allclose([lp for lp, _, _ in inp[1:]], [ref[i - 1, ids[i]] for i in range(1, len(ids))],
                               atol=1e-4)
    assert all(text == tok.decode([t]) for _, t, text in inp)
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == oids
    np.testing.assert_allclose([lp for lp, _, _ in outp], [ref[len(ids) - 1 + j, t] for j, t in enumerate(oids)],
                               atol=1e-4)
    top = meta["output_top_logprobs"]
    assert len(top) == len(oids) and all(len(e) == 3 for e in top)
    for j, e in enumerate(top):
        row = ref[len(ids) - 1 + j]
        assert e[0][1] == oids[j]  # greedy: the chosen token is the most likely one
        np.testing.assert_allclose([lp for lp, _, _ in e], np.sort(row)[::-1][:3], atol=1e-4)
        assert [text for _, _, text in e] == [tok.decode([t]) for _, t, _ in e]
    itop = meta["input_top_logprobs"]  # SGLang: None where the token has no logprob (the first), else k triples
    assert len(itop) == len(ids) and itop[0] is None and all(len(e) == 3 for e in itop[1:])
    for i, e in enumerate(itop[1:], 1):
        np.testing.assert_allclose([lp for lp, _, _ in e], np.sort(ref[i - 1])[::-1][:3], atol=1e-4)
        assert [t for _, t, _ in e] == list(np.argsort(-ref[i - 1], kind="stable")[:3])
    # Without return_logprob the fields are absent; without top_logprobs_num the top fields are absent; the default
    # logprob_start_len (-1) gives the last prompt token without a logprob; a later start gives the prompt from there
    # on, its first token without a logprob (all as SGLang).
    assert "output_token_logprobs" not in gen(server, input_ids=ids, sampling_params={"max_new_tokens": 2})[
        "meta_info"]
    meta = gen(server, input_ids=ids, return_logprob=True, sampling_params={"max_new_tokens": 2})["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ids[-1], None]] and len(meta["output_token_logprobs"]) == 2
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    meta = gen(server, input_ids=ids, return_logprob=True, logprob_start_len=2,
               sampling_params={"max_new_tokens": 2})["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[2:] and meta["input_token_logprobs"][0][0] is None
    np.testing.assert_allclose([lp for lp, _, _ in meta["input_token_logprobs"][1:]],
                               [ref[i - 1, ids[i]] for i in range(3, len(ids))], atol=1e-4)
    r = httpx.post(server.url + "/generate", json=dict(input_ids=ids, return_logprob=True,
                                                       logprob_start_len=len(ids)), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len", r.text


def test_openai_chat_logprobs_parse_and_match_native(client, server):
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=SHARED_NAME, messages=msgs, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert isinstance(e.token, str) and isinstance(e.logprob, float)
        assert e.token == bytes(e.bytes).decode("utf-8", "backslashreplace")  # a partial character: escaped bytes
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None
    streamed = [c for ch in client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **kw)
                for c in ch.choices if c.logprobs is not None for c in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_openai_completions_logprobs_and_echo(client, hf):
    tok = hf[0]
    n_prompt = len(tok(PROMPT)["input_ids"])
    r = client.completions.create(model=SHARED_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[n_prompt:]) and lp.top_logprobs[0] is None
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in lp.top_logprobs[1:n_prompt])  # prompt tops
    assert all(max(t.values()) >= x - 1e-5 for t, x in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=SHARED_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert len(chunks) > 1  # offsets run on across chunks, as in the whole response
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    plain = client.completions.create(model=SHARED_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert len(plain.choices[0].logprobs.tokens) == 4
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-5)


def test_penalties_over_http_equal_the_offline_decoder(server, model_dir, hf):
    from specjax.generate import generate
    from specjax.weights import load_model
    tok = hf[0]
    ids = tok(PROMPT)["input_ids"]
    sp = {"temperature": 0, "max_new_tokens": 12, "repetition_penalty": 1.4, "frequency_penalty": 0.5,
          "presence_penalty": 0.3, "logit_bias": {"7": 2.5, "11": -100}, "min_new_tokens": 4, "stop_token_ids": [9],
          "ignore_eos": True}
    out = gen(server, input_ids=ids, sampling_params=sp)["output_ids"]
    cfg, params = load_model(model_dir, dtype="float32")
    row = sampling.SamplingRow(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3,
                               logit_bias=((7, 2.5), (11, -100.0)), min_new_tokens=4, stop_ids=(9,))
    ref = generate(params, cfg, [ids], max_new_tokens=12, stop_token_ids=(9,), rows=[row])[0]
    assert out == ref
    assert out != gen(server, input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "ignore_eos": True})["output_ids"]
    assert 11 not in out


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens")])
def test_bad_values_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(
        model=SHARED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **body), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_zero_new_tokens_scores_the_prompt_alone(server, client, hf):
    """SGLang's prefill-only request (``max_new_tokens: 0``) and the completions API's ``max_tokens: 0`` with echo
    (what evaluation harnesses send to score a text): the prompt's logprobs, no output token, finish reason length;
    the same prompt logprobs as a request that goes on generating. max_tokens 0 without echo asks for nothing."""
    tok = hf[0]
    ids = tok(PROMPT)["input_ids"]
    ref = hf_logprobs(hf, ids)
    out = gen(server, input_ids=ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
              sampling_params={"max_new_tokens": 0})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    np.testing.assert_allclose([lp for lp, _, _ in meta["input_token_logprobs"][1:]],
                               [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)
    assert meta["output_token_logprobs"] == []
    r = client.completions.create(model=SHARED_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], [lp for lp, _, _ in
                                                                   meta["input_token_logprobs"][1:]], atol=1e-5)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=SHARED_NAME, prompt=PROMPT, max_tokens=0, echo=True, stream=True) if c.choices)
    assert streamed == PROMPT
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=SHARED_NAME, prompt=PROMPT, max_tokens=0)
    assert gen(server, text=PROMPT, sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_token_ids_logprob_matches_hf(server, hf):
    """SGLang's ``token_ids_logprob``: the logprobs of the named ids at every prompt position from
    logprob_start_len (the first None) and at every output position, equal to HF's log_softmax; one list for every
    prompt or one per prompt; bad ids, too many ids, or no return_logprob are 400s naming the field."""
    tok = hf[0]
    ids = tok(PROMPT)["input_ids"]
    want = [3, 17, 3, 60]
    out = gen(server, input_ids=ids, return_logprob=True, logprob_start_len=0, token_ids_logprob=want,
              return_text_in_logprobs=True, sampling_params={"temperature": 0, "max_new_tokens": 4,
                                                             "ignore_eos": True})
    meta, oids = out["meta_info"], out["output_ids"]
    ref = hf_logprobs(hf, ids + oids)
    inp, outp = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert len(inp) == len(ids) and inp[0] is None and len(outp) == len(oids) == 4
    for pos, entry in [(i - 1, inp[i]) for i in range(1, len(ids))] + [(len(ids) - 1 + j, e)
                                                                        for j, e in enumerate(outp)]:
        assert [t for _, t, _ in entry] == want and [x for _, _, x in entry] == [tok.decode([t]) for t in want]
        np.testing.assert_allclose([lp for lp, _, _ in entry], ref[pos, want], atol=1e-4)
    both = gen(server, input_ids=[ids, ids[:3]], return_logprob=True, token_ids_logprob=[[5], [6, 7]],
               sampling_params={"temperature": 0, "max_new_tokens": 1})
    assert [[t for _, t, _ in m["meta_info"]["output_token_ids_logprobs"][0]] for m in both] == [[5], [6, 7]]
    assert "output_token_ids_logprobs" not in gen(server, input_ids=ids, return_logprob=True,
                                                  sampling_params={"max_new_tokens": 1})["meta_info"]
    for body in ({"token_ids_logprob": [1]}, {"token_ids_logprob": [10 ** 6], "return_logprob": True},
                 {"token_ids_logprob": list(range(sampling.MAX_TOKEN_IDS_LOGPROB + 1)), "return_logprob": True}):
        r = httpx.post(server.url + "/generate", json=dict(input_ids=ids, **body), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob", r.text


def test_score_matches_hf(server, hf):
    """SGLang's ``/v1/score``: per item, the labels' next-token probabilities after query + item (HF's softmax at
    the prompt's last position), text joined before tokenizing, token ids concatenated, item_first, apply_softmax
    over the labels; bad labels and mixed inputs are 400s naming the field."""
    tok = hf[0]
    query, items, labels = "The capital of France is", [" Paris", " a city", " London"], [5, 9, 42]

    def score(**body):
        r = httpx.post(server.url + "/v1/score", json=dict(model=SHARED_NAME, label_token_ids=labels, **body),
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "scoring"
        return r.json()

    def probs(ids):
        return np.exp(hf_logprobs(hf, ids)[-1, labels])

    out = score(query=query, items=items)
    want = [probs(tok(query + x)["input_ids"]) for x in items]
    np.testing.assert_allclose(out["scores"], want, rtol=1e-3, atol=1e-7)
    assert out["usage"]["prompt_tokens"] == sum(len(tok(query + x)["input_ids"]) for x in items)
    soft = score(query=query, items=items, apply_softmax=True)["scores"]
    np.testing.assert_allclose(soft, [p / p.sum() for p in want], rtol=1e-3)
    q, its = tok(query)["input_ids"], [[7, 8], [9]]
    np.testing.assert_allclose(score(query=q, items=its, item_first=True)["scores"],
                               [probs(x + q) for x in its], rtol=1e-3, atol=1e-7)
    for body, param in (({"query": query, "items": items, "label_token_ids": [10 ** 6]}, "label_token_ids"),
                        ({"query": query, "items": items, "label_token_ids": []}, "label_token_ids"),
                        ({"query": query, "items": [[1, 2]], "label_token_ids": labels}, "items"),
                        ({"query": query, "items": [], "label_token_ids": labels}, "items")):
        r = httpx.post(server.url + "/v1/score", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- logprob tokens that hold part of a character ------------------------------------------------------------------
MULTIBYTE = "Caf\u00e9 \u65e5\u672c\u8a9e \U0001F600 \u00fcber x"  # 2-, 3- and 4-byte characters split over tokens


def split_meta(ids, prompt_ids=()):
    """SGLang meta_info with logprobs for the output ``ids`` (each its own top 1) after the prompt ``prompt_ids``."""
    return {"input_token_logprobs": [(None if j == 0 else -1.0, t, None) for j, t in enumerate(prompt_ids)],
            "input_top_logprobs": [None] + [[(-1.0, t, None)] for t in prompt_ids[1:]],
            "output_token_logprobs": [(-0.5, t, None) for t in ids],
            "output_top_logprobs": [[(-0.5, t, None)] for t in ids]}


def check_token_bytes(tok, text):
    """Chat logprobs of ``text``'s tokens: their bytes joined are the text's, partial characters are escaped bytes
    in ``token`` (OpenAI's form); completions echo offsets are where each token's bytes start (HF's offset mapping),
    streamed chunk by chunk the same."""
    from specjax.serve import protocol as P
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    content = P.chat_logprobs(split_meta(ids), tok, 1)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert any("\\x" in e["token"] for e in content), "no token splits a character: the check tests nothing"
    for e in content:
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", "backslashreplace") and "\ufffd" not in e["token"]
        assert e["top_logprobs"] == [{k: v for k, v in e.items() if k != "top_logprobs"}]
    lp = P.completion_logprobs(split_meta([], ids), tok, 1, echo=True)
    assert lp["text_offset"] == [s for s, _ in enc["offset_mapping"]]
    assert lp["tokens"] == [e["token"] for e in content]
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:]) and lp["top_logprobs"][0] is None
    out = P.completion_logprobs(split_meta(ids), tok, 1, echo=False, text_offset=3)
    assert out["text_offset"] == [3 + s for s, _ in enc["offset_mapping"]]
    chunks, offset = [], 3
    for start in range(len(ids)):
        chunk, offset = P.completion_logprobs_chunk(split_meta(ids[:start + 1]), tok, 1, False, start, offset)
        chunks += chunk["text_offset"]
    assert chunks == out["text_offset"] and offset == 3 + len(text)


def test_logprob_bytes_of_split_characters_byte_level(model_dir):
    """The tiny byte-level BPE vocabulary: most non-ASCII characters are split into single-byte tokens."""
    from transformers import AutoTokenizer
    check_token_bytes(AutoTokenizer.from_pretrained(model_dir), MULTIBYTE)


def test_logprob_bytes_of_split_characters_smollm2():
    """The audit's case on the real SmolLM2 tokenizer: its "👏👏" reply (F0 9F 91 8F twice) and a CJK prompt."""
    from real_model import smollm2_path

    from specjax.weights import load_tokenizer
    tok = load_tokenizer(smollm2_path())
    check_token_bytes(tok, "\U0001F44F\U0001F44F")
    check_token_bytes(tok, "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002 " + MULTIBYTE)


def test_logprob_bytes_sentencepiece_byte_fallback():
    """A SentencePiece-style vocabulary (Llama 2, Mistral): ``▁`` is a space, ``<0xNN>`` pieces are single bytes,
    special tokens are their text."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from specjax.serve import protocol as P
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *"\u2581helowrd", "or", "\u2581w",
              "\u2581wor"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [("o", "r"), ("\u2581", "w"), ("\u2581w", "or")],
                               byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    text = "hello \u65e5\u672c world \U0001F600"
    ids = fast(text, add_special_tokens=False)["input_ids"]
    assert "<0xE6>" in fast.convert_ids_to_tokens(ids) and "\u2581wor" in fast.convert_ids_to_tokens(ids)
    content = P.chat_logprobs(split_meta(ids + [fast.eos_token_id]), fast, 0)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode() + b"</s>"
    assert "".join(e["token"] for e in content).startswith("hello \\xe6\\x97\\xa5\\xe6\\x9c\\xac world")
    lp = P.completion_logprobs(split_meta(ids + [fast.eos_token_id]), fast, 0, echo=False)
    assert lp["text_offset"][-1] == len(text)  # the skipped special token spans nothing, at the end of the text


def test_split_characters_over_http(client, model_dir):
    """Completions echo of a prompt whose characters span several tokens: ``text_offset`` is where each token's
    bytes start in the returned text (HF's offset mapping for the prompt), never past it, the same streamed; chat
    logprobs of output tokens that are single bytes of a character: escaped ``token``, raw ``bytes``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(MULTIBYTE, return_offsets_mapping=True)
    kw = dict(model=SHARED_NAME, prompt=MULTIBYTE, max_tokens=4, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    choice = client.completions.create(**kw).choices[0]
    offsets = choice.logprobs.text_offset
    assert offsets[:len(enc["input_ids"])] == [s for s, _ in enc["offset_mapping"]]
    assert offsets == sorted(offsets) and offsets[-1] < len(choice.text)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs]
    assert [o for c in streamed for o in c.text_offset] == offsets
    assert [t for c in streamed for t in c.tokens] == choice.logprobs.tokens
    emoji = tok("\U0001F600", add_special_tokens=False)["input_ids"]
    assert len(emoji) == 4  # one token per byte: push the reply onto them
    r = client.chat.completions.create(model=SHARED_NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=1,
                                       logit_bias={str(t): 100 for t in emoji}, extra_body={"ignore_eos": True})
    r = r.choices[0]
    assert all(len(e.bytes) == 1 and e.bytes[0] in "\U0001F600".encode() for e in r.logprobs.content)
    assert all(e.token == f"\\x{e.bytes[0]:02x}" for e in r.logprobs.content)
    assert bytes(b for e in r.logprobs.content for b in e.bytes).decode("utf-8", "replace") == r.message.content
