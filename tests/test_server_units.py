"""Fast unit tests of the server's host-side pieces (no model, no HTTP): ServerArgs / CLI validation, stop strings
across token boundaries with streaming hold-back, incremental detokenization of split UTF-8, the page pool and the
radix cache (sharing, ref counts, LRU eviction)."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from specjax.bench.__main__ import main as bench_main
from specjax.bench.serve import launch_flags, median_round, speedup_cell
from specjax.heads import DEFAULT_HEAD
from specjax.hub import default_smollm2_path
from specjax.config import ConfigError, ModelConfig
from specjax.serve.args import ArgsError, ServerArgs, build_parser, parse_args
from specjax.serve.launch import LONGER_CONTEXT_ENV, build, check_context_length
from specjax.serve.pages import PagePool, RadixCache
from specjax.serve.request import (MAX_STOP_CHARS, NO_LIMIT, Request, RequestError, SamplingParams,
                                   stop_prefix_at_end)
from server_helpers import tiny_model_dir


# ---- arguments -----------------------------------------------------------------------------------------------------
def test_cli_defaults_and_aliases():
    a = parse_args(["--model", "m"])
    assert (a.model_path, a.host, a.port, a.speculative_algorithm) == ("m", "127.0.0.1", 30000, None)
    a = parse_args(["--model-path", "m", "--speculative-algorithm", "eagle3", "--speculative-draft-model", "d"])
    assert a.speculative_algorithm == "EAGLE3" and a.speculative_draft_model_path == "d"
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (5, 4, 8)
    chain = parse_args(["--model-path", "m", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                        "d", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"])
    assert chain.speculative_num_draft_tokens == 4  # steps + 1 by default for a chain


def test_cli_every_spec_flag_parses():
    flags = ["--model-path", "m", "--tokenizer-path", "t", "--host", "0.0.0.0", "--port", "1234", "--dtype",
             "bfloat16", "--tp-size", "1", "--dp-size", "1", "--mem-fraction-static", "0.5",
             "--max-running-requests", "4", "--max-total-tokens", "1024", "--context-length", "512",
             "--chunked-prefill-size", "128", "--page-size", "16", "--schedule-policy", "lpm",
             "--disable-radix-cache", "--disable-overlap-schedule", "--random-seed", "3", "--served-model-name", "x",
             "--api-key", "k",
             "--log-level", "debug", "--enable-metrics", "--skip-server-warmup", "--trust-remote-code",
             "--chat-template", "chatml", "--attention-impl", "xla", "--speculative-algorithm", "EAGLE",
             "--speculative-draft-model-path", "d", "--speculative-num-steps", "4", "--speculative-eagle-topk", "2",
             "--speculative-num-draft-tokens", "6", "--speculative-token-map", "map.pt",
             "--speculative-accept-threshold-single", "1.0", "--speculative-accept-threshold-acc", "1.0",
             "--cuda-graph-max-bs", "8", "--enable-torch-compile", "--torch-compile-max-bs", "4",
             "--attention-backend", "fa3", "--disable-cuda-graph", "--disable-cuda-graph-padding"]
    a = parse_args(flags)
    assert a.schedule_policy == "lpm" and a.disable_radix_cache and a.api_key == "k"
    assert a.disable_overlap_schedule and not parse_args(["--model", "m"]).disable_overlap_schedule
    assert len(a.notices()) == 6 and all("no effect" in n for n in a.notices())
    # a CUDA-only count given as 0 is noticed too (0 == False); the log level in any case, as SGLang takes it
    b = parse_args(["--model", "m", "--cuda-graph-max-bs", "0", "--log-level", "WARNING"])
    assert b.notices() == ["--cuda-graph-max-bs is a CUDA-only SGLang flag and has no effect in specjax"]
    assert b.log_level == "warning"
    # SGLang's relaxed acceptance, each threshold in [0, 1]: 0 is SGLang's "accept whatever the draft proposes"
    c = parse_args(["--model", "m", "--speculative-accept-threshold-single", "0", "--speculative-accept-threshold-acc",
                    "0.5"])
    assert (c.accept_thresholds.single, c.accept_thresholds.acc) == (0.0, 0.5) and a.accept_thresholds.lossless
    # an FR-Spec map with EAGLE3 is ignored with a notice, as SGLang ignores it (the head has its own vocab map)
    d = parse_args(["--model", "m", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                    "--speculative-token-map", "m.json"])
    assert d.notices() == ["--speculative-token-map is ignored with EAGLE3: the head carries its own vocab map "
                           "(d2t/t2d), as SGLang ignores it"]
    assert ServerArgs.from_kwargs(model_path="m", disable_cuda_graph=True).disable_cuda_graph  # Engine(...) too


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "EAGLE3"], "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "8"], "must be num_steps + 1 = 6"),
    (["--speculative-draft-model-path", "d"], "--speculative-algorithm is not"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--port", "0"], "--port"),
    (["--chunked-prefill-size", "0"], "-1 to disable"),
    (["--speculative-token-map", "m.json"], "--speculative-token-map is for EAGLE heads"),  # plain decoding
    # tree flags and thresholds without an algorithm: plain decoding was served, the values never checked
    (["--speculative-num-steps", "3"], "tree flags .--speculative-num-steps. need --speculative-algorithm and "
                                       "--speculative-draft-model-path"),
    (["--speculative-num-steps", "-5", "--speculative-num-draft-tokens", "2"],
     "tree flags .--speculative-num-steps, --speculative-num-draft-tokens. need"),
    (["--speculative-accept-threshold-single", "7"], "--speculative-accept-threshold-single must be in .0, 1. .got 7"),
    (["--speculative-accept-threshold-acc", "-0.5"], "--speculative-accept-threshold-acc must be in .0, 1. .got -0.5"),
    (["--schedule-conservativeness", "0"], "--schedule-conservativeness must be > 0 .got 0.0."),
    (["--schedule-conservativeness", "nan"], "--schedule-conservativeness must be > 0 .got nan."),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1 .got 0."),
    (["--decode-log-interval", "-1"], "--decode-log-interval must be >= 0 .got -1."),
    (["--watchdog-timeout", "nan"], "--watchdog-timeout must be >= 0 seconds, 0 for none .got nan."),
])
def test_cli_validation(argv, message):
    with pytest.raises(ArgsError, match=message.replace("+", r"\+")):
        parse_args(["--model-path", "m", *argv])


def test_bench_serve_configuration_flags():
    """``bench serve --launch``: a configuration's own flags after a colon go to its server alone."""
    args = SimpleNamespace(model_path="m", server_args="--page-size 8", draft="d",
                           spec_args="--speculative-eagle-topk 1")
    assert launch_flags("plain", args) == ["--model-path", "m", "--page-size", "8"]
    assert launch_flags("plain:--disable-overlap-schedule", args)[-1] == "--disable-overlap-schedule"
    eagle = launch_flags("eagle3:--speculative-num-steps 3", args)
    assert eagle[4:6] == ["--speculative-num-steps", "3"] and eagle[-2:] == ["--speculative-eagle-topk", "1"]
    assert ["--speculative-algorithm", "EAGLE3"] == eagle[6:8]
    with pytest.raises(SystemExit, match="unknown configuration 'medusa'"):
        launch_flags("medusa:--x", args)


def test_cli_with_no_model_serves_the_default_pair():
    """``python -m specjax.serve`` with no model and no speculative flag (server flags such as --port are fine)
    serves the default pair, as the README says; a speculative flag without a model is still an error."""
    for argv in ([], ["--port", "30111", "--log-level", "warning"]):
        a = parse_args(argv)
        assert (a.model_path, a.speculative_algorithm, a.speculative_draft_model_path) == (
            default_smollm2_path(), "EAGLE3", DEFAULT_HEAD)
    with pytest.raises(ArgsError, match="--model-path is required"):
        parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d"])


def test_cli_help_and_error_exit():
    out = subprocess.run([sys.executable, "-m", "specjax.serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--speculative-algorithm", "--speculative-eagle-topk", "--mem-fraction-static",
                 "--chunked-prefill-size", "--api-key", "examples:"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, "-m", "specjax.serve", "--model-path", "m", "--speculative-algorithm",
                          "EAGLE3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--speculative-draft-model-path" in bad.stderr


def test_engine_kwargs_share_the_cli_names():
    cli = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert cli == {f for f in ServerArgs.__dataclass_fields__}
    a = ServerArgs.from_kwargs(model="m", speculative_draft_model="d", speculative_algorithm="EAGLE3")
    assert a.model_path == "m" and a.speculative_draft_model_path == "d"
    with pytest.raises(ArgsError, match="unknown engine argument"):
        ServerArgs.from_kwargs(model_path="m", not_a_flag=1)
    with pytest.raises(ArgsError, match="speculative_num_steps must be int or None, got '3'"):
        ServerArgs.from_kwargs(model_path="m", speculative_num_steps="3")
    with pytest.raises(ArgsError, match="skip_server_warmup must be bool"):
        ServerArgs.from_kwargs(model_path="m", skip_server_warmup=1)
    assert ServerArgs.from_kwargs(model_path="m", mem_fraction_static=1).mem_fraction_static == 1.0
    with pytest.raises(ArgsError, match="--random-seed must be >= 0"):
        ServerArgs.from_kwargs(model_path="m", random_seed=-1).validate()


def test_import_specjax_is_light():
    code = ("import sys, specjax; assert 'jax' not in sys.modules and 'fastapi' not in sys.modules; "
            "print(specjax.Engine)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Engine" in out.stdout


# ---- requests: stops and detokenization ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir())


def run_request(tokenizer, text, **sp):
    """Feed the tokens of ``text`` one at a time; returns (request, streamed text)."""
    req = Request(rid="r", prompt_ids=tokenizer("Hi")["input_ids"], params=SamplingParams(**sp), sink=print)
    req.init_detok()
    streamed = ""
    for tok in tokenizer(text, add_special_tokens=False)["input_ids"]:
        req.append_tokens([tok], tokenizer, frozenset(), 10 ** 6)
        if req.finished:
            req.flush_text(tokenizer)
        streamed += req.stream_delta()[0]
        if req.finished:
            break
    return req, streamed


def test_stop_string_across_tokens(tokenizer):
    text = "The capital of France is Paris. The capital of Italy is Rome."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text)  # multi-character tokens, so the stop below spans tokens
    req, streamed = run_request(tokenizer, text, stop=["Italy is"], max_new_tokens=100)
    assert req.finish_reason == {"type": "stop", "matched": "Italy is"}
    assert req.text == streamed == "The capital of France is Paris. The capital of "
    req, streamed = run_request(tokenizer, text, stop=["s Par", "never"], max_new_tokens=100)
    assert streamed == "The capital of France i"


def test_streaming_holds_back_a_possible_stop(tokenizer):
    req = Request(rid="r", prompt_ids=[5], params=SamplingParams(stop=["Paris!"]), sink=print)
    req.init_detok()
    pieces = []
    for tok in tokenizer("go to Paris.", add_special_tokens=False)["input_ids"]:
        req.append_tokens([tok], tokenizer, frozenset(), 10 ** 6)
        pieces.append(req.stream_delta()[0])
        if "".join(pieces).endswith("Par"):
            assert False, "a prefix of the stop string was streamed before it was ruled out"
    req.finish_reason = {"type": "length", "length": 1}
    req.flush_text(tokenizer)
    assert "".join(pieces) + req.stream_delta()[0] == "go to Paris."


def test_the_held_back_tail_is_the_longest_that_begins_a_stop():
    """``stop_prefix_at_end`` against the definition (every tail length, longest first), on texts full of the stop's
    first character; stop strings past MAX_STOP_CHARS are refused (each step compares tails against them)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("aab"), size=rng.integers(0, 12)))
        stop = "".join(rng.choice(list("ab"), size=rng.integers(1, 7)))
        want = next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)
        assert stop_prefix_at_end(text, stop) == want, (text, stop)
    with pytest.raises(RequestError, match="at most 512 characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)]).validate()


def test_split_utf8_is_never_streamed_half(tokenizer):
    text = "Caf\u00e9 \u65e5\u672c\u8a9e \U0001F600!"
    req, streamed = run_request(tokenizer, text, max_new_tokens=100)
    assert streamed == text and "\ufffd" not in streamed


def test_length_and_stop_tokens(tokenizer):
    req, _ = run_request(tokenizer, "one two three four five six", max_new_tokens=3)
    assert req.finish_reason == {"type": "length", "length": 3} and len(req.output_ids) == 3
    req = Request(rid="r", prompt_ids=[5], params=SamplingParams(), sink=print)
    req.init_detok()
    req.append_tokens([7, 8, 0, 9], tokenizer, frozenset({0}), 10 ** 6)
    assert req.output_ids == [7, 8, 0] and req.finish_reason == {"type": "stop", "matched": 0}
    req = Request(rid="r", prompt_ids=[5], params=SamplingParams(ignore_eos=True, stop_token_ids=[9]), sink=print)
    req.init_detok()
    req.append_tokens([7, 0, 9, 4], tokenizer, frozenset({0}), 10 ** 6)
    assert req.output_ids == [7, 0, 9] and req.finish_reason["matched"] == 9


def test_no_stop_trim_keeps_the_stop(tokenizer):
    text = "The capital of France is Paris. The capital of Italy is Rome."
    req, streamed = run_request(tokenizer, text, stop=["Italy is"], max_new_tokens=100, no_stop_trim=True)
    assert req.text == streamed == "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stop_id = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    k = ids.index(stop_id)
    req, _ = run_request(tokenizer, text, stop_token_ids=[stop_id], max_new_tokens=100, no_stop_trim=True)
    assert req.finish_reason["matched"] == stop_id and req.text == tokenizer.decode(ids[:k + 1])
    req, _ = run_request(tokenizer, text, stop_token_ids=[stop_id], max_new_tokens=100)
    assert req.text == tokenizer.decode(ids[:k]) == "The capital of France is"


def test_skip_special_tokens(tokenizer):
    """A special token in the output (eos under ignore_eos) is hidden from the text by default and kept with
    skip_special_tokens=False; the output ids carry it either way."""
    ids = tokenizer("Paris is", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out = ids[:1] + [eos] + ids[1:]
    texts = {}
    for skip in (True, False):
        req = Request(rid="r", prompt_ids=[5], params=SamplingParams(ignore_eos=True, skip_special_tokens=skip,
                                                                     max_new_tokens=100), sink=print)
        req.init_detok()
        req.append_tokens(out, tokenizer, frozenset({eos}), 10 ** 6)
        req.finish_reason = {"type": "length", "length": len(out)}
        req.flush_text(tokenizer)
        assert req.output_ids == out and req.finish_reason["type"] == "length"
        texts[skip] = req.text
    assert texts[True] == tokenizer.decode(out, skip_special_tokens=True) == "Paris is"
    assert texts[False] == tokenizer.decode(out, skip_special_tokens=False) and tokenizer.eos_token in texts[False]


@pytest.mark.parametrize("bad", [{"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5},
                                 {"top_k": -3}, {"min_p": 2.0}, {"n": 0}, {"stop": [""]}, {"bogus": 1},
                                 {"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0.0},
                                 {"min_new_tokens": -1}, {"logit_bias": {"a": 1}}, {"logit_bias": {"3": 101}},
                                 {"top_logprobs_num": 21}, {"logprob_start_len": -2},
                                 {"min_new_tokens": 5, "max_new_tokens": 2},  # was served with 2 tokens
                                 {"min_new_tokens": 200}])  # over max_new_tokens' default, 128 (as SGLang)
def test_sampling_params_validation(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict(bad)
    assert e.value.param == next(iter(bad))  # refused for the bad field, which the error names


def test_sampling_params_from_dict_reads_sglang_extras_and_no_limit():
    """The Engine's one path for a dict: SGLang's extras pass at their neutral value and are refused otherwise,
    max_new_tokens None means no limit but the context (as /generate's JSON), sampling_seed is the seed."""
    sp = SamplingParams.from_dict({"max_new_tokens": None, "regex": None, "spaces_between_special_tokens": True,
                                   "sampling_seed": 7})
    assert sp.max_new_tokens == NO_LIMIT and sp.seed == 7
    assert SamplingParams.from_dict({}).max_new_tokens == 128
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict({"regex": "[a-z]+"})
    assert e.value.param == "regex" and e.value.code == "unsupported_parameter"


# ---- pages and radix cache -----------------------------------------------------------------------------------------
def test_radix_cache_share_refcount_evict():
    pool = PagePool(9)  # 8 usable pages + scratch
    rc = RadixCache(pool, page_size=2)
    a_tokens = [1, 2, 3, 4, 5, 6, 7]
    a_pages = pool.alloc(4)
    a_nodes = rc.insert(a_tokens[:6], a_pages, [])
    assert [n.page for n in a_nodes] == a_pages[:3] and all(n.ref == 1 for n in a_nodes)
    # B shares the first two pages of A
    m = rc.match([1, 2, 3, 4, 9, 9, 9], max_pages=3)
    assert [n.page for n in m] == a_pages[:2]
    rc.lock(m)
    b_pages = [n.page for n in m] + pool.alloc(2)
    b_nodes = m + rc.insert([1, 2, 3, 4, 9, 9], b_pages, m)
    assert len(b_nodes) == 3 and b_nodes[2].page == b_pages[2]
    assert rc.evict(8) == 0  # everything is referenced
    rc.unlock(a_nodes)
    pool.release([a_pages[3]])  # A's private page
    assert rc.evict(8) == 1 and pool.num_free == 8 - 4 - 2 + 1 + 1  # only A's unshared leaf goes
    rc.unlock(b_nodes)
    assert rc.evictable_pages() == 3
    assert rc.evict(1) == 1  # LRU leaf first
    assert rc.evict(8) == 2 and rc.cached_pages() == 0
    pool.release(b_pages[3:])
    assert pool.num_free == 8


def test_radix_cache_disabled_and_match_limit():
    pool = PagePool(5)
    rc = RadixCache(pool, page_size=2, enabled=False)
    assert rc.insert([1, 2, 3, 4], [1, 2], []) == [] and rc.match([1, 2, 3, 4], 2) == []
    rc = RadixCache(pool, page_size=2)
    rc.insert([1, 2, 3, 4], [1, 2], [])
    assert len(rc.match([1, 2, 3, 4, 5], max_pages=1)) == 1
    assert len(rc.match([1, 2, 3], max_pages=5)) == 1  # only full pages of the query count


@pytest.mark.parametrize("seed", range(6))
def test_radix_cache_counts_and_evicts_as_a_trie_walk_would(monkeypatch, seed):
    """The kept-current evictable count and leaf heap against the definition, over random requests that match,
    lock, insert, unlock and evict: the count is the trie's unreferenced nodes, and ``evict(k)`` frees the k least
    recently used unreferenced leaves, one after another (a freed leaf's parent may be next)."""
    from specjax.serve import pages as pages_lib
    clock = iter(range(1, 10**6))  # distinct use times (this module's clock only)
    monkeypatch.setattr(pages_lib, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    rng = np.random.default_rng(seed)
    pool = PagePool(40)
    rc = RadixCache(pool, page_size=2)
    held: list[tuple[list, list]] = []  # (nodes, private pages) per running request

    def walk():
        stack, out = list(rc.root.children.values()), []
        while stack:
            out.append(stack.pop())
            stack.extend(out[-1].children.values())
        return out

    for _ in range(300):
        op = rng.integers(3)
        if op == 0 and len(held) < 6:  # a request arrives over a prompt of a few shared-alphabet pages
            toks = [int(t) for t in rng.integers(0, 2, size=2 * int(rng.integers(1, 6)))]
            nodes = rc.match(toks, len(toks) // 2)
            rc.lock(nodes)
            need = len(toks) // 2 - len(nodes)
            if pool.num_free < need:
                rc.evict(need - pool.num_free)
            fresh = pool.alloc(need)
            if fresh is None:
                rc.unlock(nodes)
                continue
            new = rc.insert(toks, [n.page for n in nodes] + fresh, nodes)
            taken = {n.page for n in new}
            held.append((nodes + new, [p for p in fresh if p not in taken]))
        elif op == 1 and held:  # a request finishes
            nodes, private = held.pop(int(rng.integers(len(held))))
            rc.unlock(nodes)
            pool.release(private)
        else:  # pages wanted elsewhere: the definition's victims, one by one
            k = int(rng.integers(1, 4))
            gone = set()
            for _ in range(k):
                leaves = [n for n in walk() if n not in gone and n.ref == 0
                          and all(c in gone for c in n.children.values())]
                if not leaves:
                    break
                gone.add(min(leaves, key=lambda n: n.last_used))
            free_before = set(pool._free)
            assert rc.evict(k) == len(gone)
            assert set(pool._free) - free_before == {n.page for n in gone}
        nodes = walk()
        assert rc.evictable_pages() == sum(n.ref == 0 for n in nodes) and rc.cached_pages() == len(nodes)
        assert pool.num_free + len(nodes) + sum(len(p) for _, p in held) == pool.capacity


def test_throughput_window_counts_the_last_ten_seconds(monkeypatch):
    """/get_server_info's gen_throughput: tokens of the decode steps in the last THROUGHPUT_WINDOW_S seconds over the
    time since the oldest of them (steps that fell out of the window no longer count)."""
    from specjax.serve import metrics as metrics_lib
    clock = [100.0]
    monkeypatch.setattr(metrics_lib.time, "monotonic", lambda: clock[0])
    m = metrics_lib.Metrics(enabled=False)
    assert m.throughput() == 0.0
    for t, n in ((100.0, 16), (102.0, 16), (104.0, 8)):
        clock[0] = t
        m.on_step(n, 16, 0.05)
    clock[0] = 108.0
    assert m.throughput() == pytest.approx(40 / 8.0)
    clock[0] = 111.0  # the step at 100 s left the window
    assert m.throughput() == pytest.approx(24 / 9.0)
    clock[0] = 120.0
    assert m.throughput() == 0.0


def test_bench_serve_rounds_report_the_median_round():
    """``bench serve --rounds``: each level's row is its round of median output tokens/s (its own latencies), and
    side by side the speedup is the median of the ratios of servers measured in the same round, with their range."""
    rounds = [{"out_tok_per_s": t, "ttft_p50_ms": ms} for t, ms in ((100.0, 5.0), (80.0, 9.0), (120.0, 4.0))]
    row = median_round(rounds)
    assert row["out_tok_per_s"] == 100.0 and row["ttft_p50_ms"] == 5.0
    assert row["rounds_out_tok_per_s"] == [100.0, 80.0, 120.0]
    assert median_round(rounds[:2])["out_tok_per_s"] == 80.0 and "rounds_out_tok_per_s" not in median_round(rounds[:1])
    base = dict(median_round([{"out_tok_per_s": t} for t in (100.0, 50.0, 100.0)]), interleaved=True)
    spec = dict(median_round([{"out_tok_per_s": t} for t in (90.0, 60.0, 110.0)]), interleaved=True)
    assert speedup_cell(spec, base) == "1.10x (0.90-1.20)"  # per round: 0.9, 1.2, 1.1
    # servers launched one after another: their rounds were not side by side, so the ratio of the median rows
    assert speedup_cell({k: v for k, v in spec.items() if k != "interleaved"}, base) == "0.90x"


def test_a_draft_head_given_as_the_model_is_named_as_such():
    """``--model-path`` at a draft head (or any unsupported model): the architecture error, before the tokenizer
    (which failed first with a message about sentencepiece)."""
    with pytest.raises(ConfigError, match="unsupported architecture \\['LlamaForCausalLMEagle3'\\]"):
        build(parse_args(["--model-path", DEFAULT_HEAD]))


def test_a_missing_chat_template_is_said_before_the_model_loads():
    """``--chat-template`` naming no file and no built-in: the error comes first (it came after ~14 s of loading)."""
    with pytest.raises(ValueError, match="--chat-template '/nonexistent.jinja' is neither a file nor a built-in"):
        build(parse_args(["--model-path", DEFAULT_HEAD, "--chat-template", "/nonexistent.jinja"]))


def test_a_context_longer_than_the_model_is_refused(monkeypatch):
    """--context-length past max_position_embeddings is refused before any weight loads (SGLang's override variable
    allows it)."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir())
    n = cfg.max_position_embeddings
    assert check_context_length(ServerArgs.from_kwargs(model_path="m"), cfg) == n
    assert check_context_length(ServerArgs.from_kwargs(model_path="m", context_length=n // 2), cfg) == n // 2
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings"):
        check_context_length(ServerArgs.from_kwargs(model_path="m", context_length=2 * n), cfg)
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "1")
    assert check_context_length(ServerArgs.from_kwargs(model_path="m", context_length=2 * n), cfg) == 2 * n


class _KeyedServer(http.server.BaseHTTPRequestHandler):
    """A server that lists a model to anyone and refuses every completion (as a wrong --api-key would get)."""

    def do_GET(self):
        self._answer(200, {"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        self._answer(401, {"error": "invalid api key"})

    def _answer(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _keyed_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _nobody_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("argv, said", [
    (["--concurrency", "4", "0"], "--concurrency must be at least 1"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),  # was a ZeroDivisionError
    (["--max-tokens", "-1"], "--max-tokens must be at least 0"),
    (["--request-timeout", "0"], "--request-timeout must be more than 0 seconds"),  # every request then failed
    (["--launch-timeout", "-1"], "--launch-timeout must be more than 0 seconds"),
])
def test_bench_serve_refuses_sizes_up_front(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["serve", "--url", _nobody_url()] + argv)
    assert e.value.code == 2 and f"error: {said}" in capsys.readouterr().err


def test_bench_serve_says_what_is_wrong_in_one_line(tmp_path, capsys):
    """No server at --url (was httpx's ConnectError traceback), a prompt file without prompts (a ZeroDivisionError),
    every request of a level failing (a table of nan, exit 0): one line each, exit 2."""
    url = _nobody_url()
    assert bench_main(["serve", "--url", url, "--prompts", "builtin"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m specjax.bench serve: error: no server answers at {url}")
    assert "python -m specjax.serve" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    (tmp_path / "p.jsonl").write_text('{"id": 1}\n')
    assert bench_main(["serve", "--url", url, "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert f"error: no usable prompts in {tmp_path / 'p.jsonl'}" in capsys.readouterr().err
    with _keyed_server() as url:
        assert bench_main(["serve", "--url", url, "--prompts", "builtin", "--num-prompts", "2", "--concurrency", "1",
                           "--warmup-requests", "0"]) == 2
        out, err = capsys.readouterr()
        assert f"error: all 2 requests to {url} at concurrency 1 failed, e.g. HTTP 401" in err and "nan" not in out
        # the warm-up's failures are said as the warm-up's (they named its concurrency, 2, not the user's)
        assert bench_main(["serve", "--url", url, "--prompts", "builtin", "--num-prompts", "1", "--concurrency", "1",
                           "--warmup-requests", "2"]) == 2
        assert f"error: all 1 warm-up requests to {url} failed, e.g. HTTP 401" in capsys.readouterr().err
