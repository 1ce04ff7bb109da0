"""The scheduler against a fake runner (numpy only, no model): it checks that every prefill sees its reused prefix
pages holding exactly the right tokens, that requests wait for pages and evict cached prefixes under pressure, that
the pool drains back to empty, and that failures (a bad prefill, a failing step, a broken tokenizer or consumer)
fail only what they must while the scheduler keeps serving."""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import pytest

from specjax.serve.budget import TokenRatio
from specjax.serve.pages import PagePool, RadixCache
from specjax.serve.request import RequestError, SamplingParams
from specjax.serve.runners.base import Launched
from specjax.serve import scheduler as scheduler_lib
from specjax.serve.scheduler import PriorityPolicy, Scheduler
from specjax.serve.watchdog import Watchdog

V = 50
BAD_TOKEN = 49  # the fake tokenizer fails on it; random prompts stay below 30


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        if BAD_TOKEN in ids:
            raise RuntimeError(f"cannot decode token {BAD_TOKEN}")
        return "".join(chr(97 + i % 26) for i in ids)


class FakeRunner:
    """Next token = (previous + 1) % V; W tokens per step. Keeps what each pool position holds and checks that
    prefill's reused prefix is really there."""

    def __init__(self, max_batch=4, pages_per_seq=8, page_size=4, num_pages=12, tokens_per_step=1):
        self.max_batch, self.pages_per_seq, self.page_size, self.num_pages = max_batch, pages_per_seq, page_size, \
            num_pages
        self.tokens_per_step = tokens_per_step
        self.fail_prefill_on: int | None = None
        self.fail_steps = 0
        self.fail_collects = 0  # a step that fails when its tokens are read (an asynchronous device error)
        self.prefix_checks = 0
        self.launches = 0

    def init_state(self):
        return {"pool": np.full((self.num_pages, self.page_size), -1), "rows": {}, "len": {}, "last": {}}

    def _write(self, state, slot, pos, tok):
        row = state["rows"][slot]
        assert row[pos // self.page_size] != 0, f"slot {slot} wrote position {pos} outside its pages"  # 0: scratch
        state["pool"][row[pos // self.page_size], pos % self.page_size] = tok

    def prefill(self, state, slot, tokens, page_row, sampling, cached=0):
        tokens = list(tokens)
        if self.fail_prefill_on is not None and self.fail_prefill_on in tokens:
            raise ValueError("bad prompt")
        state["rows"][slot] = list(page_row)
        for p in range(cached):  # the reused prefix must already hold these tokens
            assert state["pool"][page_row[p // self.page_size], p % self.page_size] == tokens[p], (p, tokens)
        self.prefix_checks += cached > 0
        for p in range(cached, len(tokens)):
            self._write(state, slot, p, tokens[p])
        state["len"][slot] = len(tokens)
        state["last"][slot] = (tokens[-1] + 1) % V
        return state, state["last"][slot]

    def launch(self, state, active):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("device fault")
        w = self.tokens_per_step
        self.launches += bool(np.any(active))
        toks = np.zeros((self.max_batch, w), np.int32)
        counts = np.zeros((self.max_batch,), np.int32)
        for b in np.nonzero(active)[0]:
            t = state["last"][b]
            for j in range(w):
                self._write(state, b, state["len"][b], t)  # the fed-back token goes into the cache
                state["len"][b] += 1
                toks[b, j] = t = (t + 1) % V
            state["last"][b] = t
            counts[b] = w
        return state, Launched(np.asarray(active, bool), self.max_batch, toks, counts)

    def collect(self, launched, keep=None):
        if self.fail_collects:
            self.fail_collects -= 1
            raise RuntimeError("device fault at read")
        return launched.read(self.tokens_per_step, keep)

    def release(self, state, slot):
        state["rows"].pop(slot, None)
        return state

    def set_page_rows(self, state, rows):
        for slot, row in rows.items():
            old = state["rows"][slot]
            assert all(row[i] == p for i, p in enumerate(old) if p), "a running slot's pages changed"
            state["rows"][slot] = list(row)
        return state

    def slot_row(self, state, slot):
        return None  # no sampling state: the next token is the previous + 1


def expected(prompt, n):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = (t + 1) % V
        out.append(t)
    return out


def make(runner=None, **kw):
    s = Scheduler(runner or FakeRunner(), FakeTokenizer(), context_length=28, vocab_size=V, **kw)
    s.start()
    return s


def run(sched, prompt, n, priority=None, **sp):
    q: queue.Queue = queue.Queue()
    sched.submit(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, **sp), q.put, priority=priority)
    ids = []
    while True:
        ev = q.get(timeout=30)
        ids += ev["token_ids"]
        if ev["finished"]:
            return ids, ev["meta_info"]


def run_together(sched, prompts, n, priorities=None, **sp):
    """``run`` of every prompt at once: all wait (a pause) until the last is queued, then the scheduler goes on."""
    results = [None] * len(prompts)
    priorities = priorities or [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(sched, prompts[i], n, priorities[i],
                                                                               **sp)))
               for i in range(len(prompts))]
    sched.pause_generation("in_place")
    for t in threads:
        t.start()
    while sched.stats()["num_waiting_reqs"] < len(prompts):
        time.sleep(0.005)
    sched.continue_generation()
    for t in threads:
        t.join(60)
    return results


def wait_idle(sched):
    for _ in range(200):
        st = sched.stats()
        if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
            return st
        time.sleep(0.02)
    return sched.stats()


@pytest.mark.parametrize("w,overlap", [(1, True), (3, True), (3, False)])
def test_many_requests_through_a_small_pool(w, overlap):
    runner = FakeRunner(tokens_per_step=w)
    sched = make(runner, chunked_prefill_size=5, overlap_schedule=overlap)
    rng = np.random.default_rng(w)
    shared = [int(x) for x in rng.integers(0, 30, 9)]
    jobs = []
    for i in range(24):
        prompt = (shared if i % 2 else []) + [int(x) for x in rng.integers(0, 30, rng.integers(1, 8))]
        jobs.append((prompt, int(rng.integers(1, 12))))
    results = [None] * len(jobs)

    def client(i):
        results[i] = run(sched, *jobs[i], ignore_eos=True)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (prompt, n), (ids, meta) in zip(jobs, results):
        assert ids == expected(prompt, n) and meta["finish_reason"] == {"type": "length", "length": n}
    assert runner.prefix_checks > 0  # prefixes were reused (and verified)
    st = wait_idle(sched)
    assert st["kv_pages_used"] == 0 and st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"]
    assert sched.flush_cache() and sched.stats()["kv_pages_free"] == st["kv_pages_total"]
    sched.shutdown()


def test_refusal_and_clamping():
    sched = make()
    with pytest.raises(RequestError, match="context length"):
        sched.submit(list(range(28)), SamplingParams(), print)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        sched.submit([1, V], SamplingParams(), print)
    # A prompt past the context is refused on its length before any id is looked at (the server calls submit on its
    # event loop: Python passes over a million ids held /health for a second), whatever its ids are.
    with pytest.raises(RequestError, match="has 1000000 tokens") as e:
        sched.submit([V + 1] * 1_000_000, SamplingParams(), print)
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    ids, meta = run(sched, [1, 2, 3], 100, ignore_eos=True)  # clamped to the 28-token context
    assert len(ids) == 25 and meta["finish_reason"]["type"] == "length"
    sched.shutdown()


def test_overlap_falls_back_where_a_step_could_outrun_the_pages():
    """Four tokens a step and a context-capped request: its page row (32 positions) covers one step past its budget,
    not two, so near its end each step is collected before the next launches (the fake runner fails on a write
    outside a slot's pages); the tokens are the same either way."""
    runner = FakeRunner(tokens_per_step=4, max_batch=2)
    sched = make(runner)
    ids, meta = run(sched, [1, 2], 100, ignore_eos=True)
    assert ids == expected([1, 2], 26) and meta["finish_reason"]["type"] == "length"
    sched.shutdown()


def test_overlap_reserves_pages_for_the_step_after_the_last(monkeypatch):
    """The step launched before the finishing one is collected writes up to two steps past the budget: with one-token
    pages and no pages beyond the next steps' (GROW_PAGES 0) the pages are exact, and a request whose last step
    overshoots its budget needs it (n = 11: three steps give 13 tokens, the fourth writes positions 14-17, past
    what the host has collected by two steps). No step is launched after one that finishes a request for certain
    (n = 10: one token left when the third step is in flight)."""
    monkeypatch.setattr(scheduler_lib, "GROW_PAGES", 0)
    runner = FakeRunner(tokens_per_step=4, page_size=1, pages_per_seq=40, num_pages=60)
    sched = make(runner)
    for n, launches in ((9, 3), (10, 3), (11, 4), (12, 4)):
        before = runner.launches
        assert run(sched, [1, 2], n, ignore_eos=True)[0] == expected([1, 2], n)
        wait_idle(sched)
        assert runner.launches - before == launches, n  # the steps its tokens need (+ one unseen, overlapped)
    sched.shutdown()


def test_failures_stay_contained():
    runner = FakeRunner()
    sched = make(runner)
    runner.fail_prefill_on = 42
    ids, meta = run(sched, [1, 42, 3], 5)
    assert meta["finish_reason"]["type"] == "abort" and "bad prompt" in meta["finish_reason"]["message"]
    assert run(sched, [1, 2, 3], 5, ignore_eos=True)[0] == expected([1, 2, 3], 5)
    # a token the tokenizer cannot decode fails that request only
    ids, meta = run(sched, [46, 47], 6, ignore_eos=True)
    assert meta["finish_reason"]["type"] == "abort" and "token 49" in meta["finish_reason"]["message"]
    assert run(sched, [20, 21], 4, ignore_eos=True)[0] == expected([20, 21], 4)
    # a request whose final meta info cannot be built still gets its final event (its consumer would wait forever)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, return_logprob=True)
    sp.top_logprobs_num = "3"  # past validation: what a future field bug could do
    q: queue.Queue = queue.Queue()
    sched.submit([5, 6], sp, q.put)
    while not (ev := q.get(timeout=30))["finished"]:
        pass
    assert ev["meta_info"]["finish_reason"]["type"] == "abort"
    # a consumer that raises does not hurt the scheduler
    sched.submit([5, 6], SamplingParams(max_new_tokens=3), lambda ev: 1 / 0)
    assert run(sched, [30, 31], 4, ignore_eos=True)[0] == expected([30, 31], 4)
    # a failing step fails the running batch, resets, and the scheduler goes on
    runner.fail_steps = 1
    ids, meta = run(sched, [1, 2], 5, ignore_eos=True)
    assert meta["finish_reason"]["type"] == "abort" and "device fault" in meta["finish_reason"]["message"]
    assert run(sched, [1, 2], 5, ignore_eos=True)[0] == expected([1, 2], 5)
    # so does one whose failure shows only when its tokens are read, a step after it was launched
    runner.fail_collects = 1
    ids, meta = run(sched, [1, 2], 5, ignore_eos=True)
    assert meta["finish_reason"]["type"] == "abort" and "fault at read" in meta["finish_reason"]["message"]
    assert run(sched, [1, 2], 5, ignore_eos=True)[0] == expected([1, 2], 5)
    assert sched.alive and wait_idle(sched)["kv_pages_used"] == 0
    sched.shutdown()


def test_stop_token_inside_a_multi_token_step_and_abort_while_waiting():
    runner = FakeRunner(tokens_per_step=4, max_batch=1)
    sched = make(runner)
    ids, meta = run(sched, [1, 2], 20, stop_token_ids=[6])
    assert ids == [3, 4, 5, 6] and meta["finish_reason"] == {"type": "stop", "matched": 6}
    # with one slot, a second request waits; aborting it finishes it without ever running
    q1: queue.Queue = queue.Queue()
    q2: queue.Queue = queue.Queue()
    sched.submit([1], SamplingParams(max_new_tokens=24, ignore_eos=True), q1.put, rid="long")
    sched.submit([2], SamplingParams(max_new_tokens=4, ignore_eos=True), q2.put, rid="waiting")
    sched.abort("waiting")
    ev = q2.get(timeout=10)
    assert ev["finished"] and ev["meta_info"]["finish_reason"]["type"] == "abort"
    assert ev["meta_info"]["completion_tokens"] == 0
    while not (ev := q1.get(timeout=10))["finished"]:
        pass
    assert ev["meta_info"]["completion_tokens"] == 24
    sched.shutdown()


def test_a_rid_in_flight_is_refused_until_it_finishes():
    """One rid, one request at a time: an abort names a rid, so a second request under it is refused (and the
    first untouched); a finished request's rid is free again."""
    sched = make(FakeRunner(max_batch=1))
    gate, q = threading.Event(), queue.Queue()

    def held(ev):  # holds the scheduler at the first event: the request stays in flight
        gate.wait(10)
        q.put(ev)
    sched.submit([1], SamplingParams(max_new_tokens=6, ignore_eos=True), held, rid="r")
    with pytest.raises(RequestError) as e:
        sched.submit([2], SamplingParams(max_new_tokens=4), q.put, rid="r")
    assert (e.value.param, e.value.code) == ("rid", "duplicate_rid")
    sched.submit([2], SamplingParams(max_new_tokens=4), q.put, rid="other")  # another rid is fine meanwhile
    gate.set()
    finished = {}
    while len(finished) < 2:
        ev = q.get(timeout=10)
        if ev["finished"]:
            finished[ev["meta_info"]["id"]] = ev["meta_info"]
    assert finished["r"]["completion_tokens"] == 6 and finished["r"]["finish_reason"]["type"] == "length"
    sched.submit([3], SamplingParams(max_new_tokens=2, ignore_eos=True), q.put, rid="r")  # free again
    while not (ev := q.get(timeout=10))["finished"]:
        pass
    assert ev["meta_info"]["id"] == "r" and ev["meta_info"]["completion_tokens"] == 2
    sched.shutdown()


def test_an_abort_by_the_clients_rid_stops_every_copy():
    """A batch or n > 1 under one client rid runs as rid-k-j requests (``group`` = the client's rid): an abort by
    the client's rid reaches each of them, running or waiting, as SGLang's does; another group is untouched."""
    sched = make(FakeRunner(max_batch=2))
    qs = {r: queue.Queue() for r in ("g-0-0", "g-0-1", "g-0-2", "h")}
    for rid, q in qs.items():
        sched.submit([1], SamplingParams(max_new_tokens=24, ignore_eos=True), q.put, rid=rid,
                     group=None if rid == "h" else "g")
    sched.abort("g")
    for rid, q in qs.items():
        while not (ev := q.get(timeout=10))["finished"]:
            pass
        assert ev["meta_info"]["finish_reason"]["type"] == ("length" if rid == "h" else "abort"), rid
    sched.shutdown()


def test_metrics_count_every_prompt_chunk_and_every_token_delivered():
    """The Prometheus counters agree with the scheduler's totals: a prompt prefilled in several chunks counts
    whole, and generation counts the tokens requests received (the prefill's first included, none past a stop)."""
    pytest.importorskip("prometheus_client")
    from specjax.serve.metrics import Metrics
    m = Metrics(enabled=True)
    sched = make(FakeRunner(tokens_per_step=4), chunked_prefill_size=4, metrics=m)
    ids, _ = run(sched, list(range(10)), 20, stop_token_ids=[16])
    assert ids == [10, 11, 12, 13, 14, 15, 16]  # the step that emits 16 also made 17, 18, which are dropped
    get = lambda name: m.registry.get_sample_value(name, {"model_name": ""})  # noqa: E731
    assert get("specjax:prompt_tokens_total") == 10 == sched.totals["prompt_tokens"]
    assert get("specjax:generation_tokens_total") == 7 == sched.totals["generated_tokens"]
    sched.shutdown()


def test_shutdown_answers_what_is_in_flight_and_refuses_what_comes_after():
    """A consumer never waits forever: requests running or waiting when the scheduler stops finish with an abort,
    and a request submitted after it stopped is refused at once."""
    runner = FakeRunner(max_batch=1)
    sched = make(runner)
    gate = threading.Event()
    q1, q2 = queue.Queue(), queue.Queue()

    def held(ev):  # holds the scheduler thread inside the first step's event
        gate.wait(10)
        q1.put(ev)
    sched.submit([1], SamplingParams(max_new_tokens=24, ignore_eos=True), held)
    sched.submit([2], SamplingParams(max_new_tokens=4, ignore_eos=True), q2.put)  # waits for the slot
    stopper = threading.Thread(target=sched.shutdown)
    stopper.start()
    assert sched._stop.wait(10)  # shutdown has begun while the first request's step is held
    gate.set()
    stopper.join(20)
    for q in (q1, q2):
        while not (ev := q.get(timeout=10))["finished"]:
            pass
        assert ev["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        sched.submit([3], SamplingParams(max_new_tokens=4), q2.put)


def _finish_order(policy: str, budgets=(3, 9, 6, 4), seed: int = 0) -> list[int]:
    """Indices of requests (submitted in order, token budgets ``budgets``) in the order they finish, one slot and
    all of them waiting when the scheduler starts."""
    sched = Scheduler(FakeRunner(max_batch=1), FakeTokenizer(), context_length=28, vocab_size=V,
                      schedule_policy=policy, random_seed=seed)
    done: queue.Queue = queue.Queue()
    for i, n in enumerate(budgets):
        sched.submit([1 + i], SamplingParams(max_new_tokens=n, ignore_eos=True),
                     lambda ev, i=i: done.put(i) if ev["finished"] else None)
    sched.start()
    order = [done.get(timeout=30) for _ in budgets]
    sched.shutdown()
    return order


def test_admission_orders_of_the_schedule_policies():
    """--schedule-policy: fcfs admits in arrival order, lof (SGLang's longest output first) the largest
    max_new_tokens first, random a shuffled order that --random-seed fixes."""
    assert _finish_order("fcfs") == [0, 1, 2, 3]
    assert _finish_order("lof") == [1, 2, 3, 0]
    shuffled = {s: _finish_order("random", seed=s) for s in range(4)}
    assert all(sorted(o) == [0, 1, 2, 3] for o in shuffled.values())
    assert len(set(map(tuple, shuffled.values()))) > 1 and _finish_order("random", seed=2) == shuffled[2]


def test_dfs_weight_order_walks_the_heaviest_shared_prefixes_first():
    """SGLang's dfs-weight: depth first through the cached prefixes, the subtree holding more waiting requests first
    (ties in the trie's order), a node's own requests after its subtree's, requests with nothing cached last."""
    pool = PagePool(16)
    radix = RadixCache(pool, page_size=2)
    paths = {"A": [1, 2, 3, 4, 5, 6], "B": [1, 2, 3, 4, 7, 8], "C": [1, 2, 9, 10], "D": [11, 12]}
    for tokens in paths.values():
        held = radix.match(tokens, len(tokens) // 2)
        radix.unlock(radix.insert(tokens, [0] * len(held) + pool.alloc(len(tokens) // 2 - len(held)), held))
    last = lambda tokens: (radix.match(tokens, len(tokens) // 2) or [None])[-1]  # noqa: E731
    nodes = [last(paths["D"] + [0, 0]), last(paths["C"]), last(paths["A"] + [5]), last(paths["B"]),
             last([1, 2, 3, 4, 0, 0]), last([99, 98])]
    assert nodes[5] is None and nodes[4] is last([1, 2, 3, 4])
    assert radix.dfs_weight_order(nodes) == [2, 3, 4, 1, 0, 5]
    assert _finish_order("dfs-weight") == [0, 1, 2, 3]  # nothing cached: arrival order


@pytest.mark.parametrize("w,overlap,grow", [(1, True, 4), (3, True, 4), (3, False, 4), (1, True, 0), (3, True, 0),
                                             (3, False, 0)])
def test_pages_come_as_requests_grow_and_retraction_frees_them(w, overlap, grow, monkeypatch):
    """Pages are handed out as requests grow: two requests of 20 tokens each run at once in 11 (12 at three tokens a
    step) pages of 4 tokens, where reserving their budgets at admission (7-8 pages each) ran one at a time; when the
    pool runs dry the one with the fewest output tokens is retracted, prefilled again later over its prompt and output,
    and every request still gets its tokens (the fake runner fails on a write outside a slot's pages: with ``grow`` 0 no
    request holds a page beyond what its next steps write, so a short reach fails)."""
    monkeypatch.setattr(scheduler_lib, "GROW_PAGES", grow)
    runner = FakeRunner(tokens_per_step=w, num_pages=12 if w == 1 else 13)
    peak = []
    launch = runner.launch
    runner.launch = lambda state, active: (peak.append(int(np.sum(active))), launch(state, active))[1]
    sched = make(runner, overlap_schedule=overlap)
    prompts = [[1, 2, 3], [7, 8], [11, 12, 13, 14], [20]]
    results = run_together(sched, prompts, 20, ignore_eos=True)
    for p, (ids, meta) in zip(prompts, results):
        assert ids == expected(p, 20) and meta["finish_reason"]["type"] == "length"
    st = wait_idle(sched)
    assert max(peak) >= 2 and st["retracted"] >= 1
    assert 0.0 < st["new_token_ratio"] <= 1.0
    assert st["kv_pages_used"] == 0 and st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"]
    sched.shutdown()


def test_token_ratio_follows_sglangs_constants_and_variables():
    r = TokenRatio.of()
    assert (r.init, r.floor, r.retract_steps, r.clip) == (0.7, pytest.approx(0.7 * 0.14), 20, 4096)
    assert r.expected(10_000) == pytest.approx(0.7 * 4096) and r.expected(-3) == 0
    for _ in range(600):
        r.step()
    assert r.value == pytest.approx(r.floor)
    r.step()
    assert r.value == r.floor
    r.after_retraction(emitted=100, budgets=1000, running=3)  # (100 + 20 x 3) / 1000
    assert r.value == pytest.approx(0.16)
    r.after_retraction(emitted=900, budgets=1000, running=5)
    assert r.value == 1.0
    assert TokenRatio.of(2.0).init == 1.0 and TokenRatio.of(0.5).init == pytest.approx(0.35)
    e = TokenRatio.of(env={"SGLANG_INIT_NEW_TOKEN_RATIO": "0.5", "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "100",
                           "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "10", "SGLANG_RETRACT_DECODE_STEPS": "3"})
    assert (e.init, e.clip, e.retract_steps, e.expected(1000)) == (0.5, 100, 3, 50.0)
    assert e.decay == pytest.approx((0.5 - 0.5 * 0.14) / 10)
    for env, said in (({"SGLANG_INIT_NEW_TOKEN_RATIO": "x"}, "is not a number"),
                      ({"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "-1"}, r"must be in \[0, 1\]"),
                      ({"SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "2"}, r"must be in \[0, 1\]"),
                      ({"SGLANG_RETRACT_DECODE_STEPS": "-3"}, "must be >= 0"),
                      ({"SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "0"}, "must be >= 1")):
        with pytest.raises(ValueError, match=said):
            TokenRatio.of(env=env)


def test_max_prefill_tokens_bounds_a_round_and_batch_logs_follow_sglang(caplog):
    """A prefill round spends the smaller of ``--chunked-prefill-size`` and ``--max-prefill-tokens`` over all
    requests; SGLang's "Prefill batch." (uncached prompts: no cached tokens) and "Decode batch." lines are logged."""
    runner = FakeRunner()
    events = []
    prefill = runner.prefill
    runner.prefill = lambda state, slot, tokens, *a, cached=0: (events.append(len(tokens) - cached),
                                                                 prefill(state, slot, tokens, *a, cached=cached))[1]
    sched = make(runner, chunked_prefill_size=12, max_prefill_tokens=5, decode_log_interval=2)
    prefill_round = sched._prefill_round
    sched._prefill_round = lambda: (events.append("round"), prefill_round())[1]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18]]
    with caplog.at_level(logging.INFO, logger="specjax.serve"):
        results = run_together(sched, prompts, 4)
    assert [r[0] for r in results] == [expected(p, 4) for p in prompts]
    rounds, current = [], 0
    for e in events + ["round"]:
        if e == "round":
            rounds, current = rounds + [current] * (current > 0), 0
        else:
            current += e
    assert max(rounds) == 5 and sum(rounds) == sum(map(len, prompts))  # 18 tokens, 12 a round without the cap
    text = caplog.text
    assert "Prefill batch. #new-seq: 1, #new-token: 5, #cached-token: 0, #running-req: " in text
    assert "Decode batch. #running-req: " in text and "gen throughput (token/s): " in text
    sched.shutdown()


def test_a_dry_pool_retracts_the_lowest_priority_first():
    """With priority scheduling the request retracted when the pool runs dry is the lowest-priority one, though
    SGLang's order alone (the fewest outputs first) would pick the other, which joined later (admission counts one
    token of each budget, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=1, so it joins at once). Both get their tokens."""
    runner = FakeRunner(num_pages=11)
    launch = runner.launch
    runner.launch = lambda state, active: (time.sleep(0.002), launch(state, active))[1]  # a step takes a while
    sched = make(runner, chunked_prefill_size=2, priority=PriorityPolicy(preemption_threshold=1000),
                 token_ratio=TokenRatio.of(env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1"}))
    retract, victims = sched._retract, []
    sched._retract = lambda req: (victims.append(req.priority), retract(req))[1]
    results = {}
    low = threading.Thread(target=lambda: results.__setitem__(0, run(sched, [7, 8], 22, 0, ignore_eos=True)))
    low.start()
    while sched.call(lambda: sum(len(r.output_ids) for r in sched.slots if r is not None)) < 4:
        time.sleep(0.001)
    results[1] = run(sched, [1, 2, 3], 22, 5, ignore_eos=True)
    low.join(60)
    assert results[0][0] == expected([7, 8], 22) and results[1][0] == expected([1, 2, 3], 22)
    assert victims and victims[0] == 0
    sched.shutdown()


def test_the_watchdog_ends_a_hung_iteration_but_not_an_idle_or_paused_server():
    """SGLang's --watchdog-timeout: an iteration stuck in a device call past the timeout fires the watchdog (which
    ends a real server's process); an idle server, a paused one and control calls between iterations do not."""
    release, fired = threading.Event(), threading.Event()
    runner = FakeRunner()
    launch = runner.launch
    runner.launch = lambda state, active: (release.wait(30), launch(state, active))[1]  # a hung step
    sched = make(runner, watchdog=Watchdog(0.3, on_hang=fired.set))
    time.sleep(0.8)  # idle
    sched.call(lambda: time.sleep(0.8))  # a control call (warmup, a weight load) runs between iterations
    sched.pause_generation("in_place")
    time.sleep(0.8)
    sched.continue_generation()
    assert not fired.is_set()
    q: queue.Queue = queue.Queue()
    sched.submit([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0), q.put)
    assert fired.wait(10)
    release.set()
    while not (ev := q.get(timeout=30))["finished"]:
        pass
    sched.shutdown()


def test_the_watchdog_ends_the_process_with_every_threads_stack():
    import subprocess
    import sys
    code = ("import logging, time; logging.basicConfig(); from specjax.serve.watchdog import Watchdog; "
            "w = Watchdog(0.2); w.start(); w.begin(); time.sleep(30)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "--watchdog-timeout" in r.stderr and "most recent call first" in r.stderr  # the log line, the stacks


@pytest.mark.parametrize("overlap", [True, False])
def test_auto_truncate_limits_where_the_pool_is_smaller_than_the_context(overlap):
    """A 5-page pool of 4-token pages (20 tokens) under a 28-token context: the longest prompt served leaves one
    output token and the pages a step in flight may write (two steps overlapped, one without); with
    --allow-auto-truncate an output limit past the pool is lowered to fit, without it refused."""
    limit = 20 - (2 if overlap else 1) - 1
    for auto in (True, False):
        s = make(FakeRunner(num_pages=6), auto_truncate=auto, overlap_schedule=overlap)
        try:
            assert s.max_prompt_len() == limit
            prompt = list(range(1, limit + 1))
            assert run(s, prompt, 1)[0] == expected(prompt, 1)
            if auto:
                assert run(s, prompt, 10)[0] == expected(prompt, 1)
            else:
                with pytest.raises(RequestError, match="KV pool"):
                    run(s, prompt, 10)
            with pytest.raises(RequestError, match="KV pool"):
                run(s, prompt + [5], 1)
        finally:
            s.shutdown()


@pytest.mark.parametrize("chunk", [8, -1])
def test_a_prompt_sharing_a_prefix_with_a_prefill_in_progress_finds_it_cached(chunk):
    """SGLang's in-batch prefix caching: of two prompts sharing 40 tokens submitted together, one waits for the
    other's prefill (chunk by chunk with an 8-token chunk, or at once) and finds those 40 tokens cached, instead of
    computing them again and holding them twice; both give the fake model's tokens. A prefix under 32 tokens is not
    waited for."""
    runner = FakeRunner(pages_per_seq=16, num_pages=40)
    sched = Scheduler(runner, FakeTokenizer(), context_length=64, vocab_size=V, chunked_prefill_size=chunk)
    sched.start()
    shared = [i % 20 + 1 for i in range(40)]
    for prompts, hit in (([shared + [3], shared + [7, 8]], 40), ([shared[:28] + [3], shared[:28] + [7, 8]], 0)):
        sched.flush_cache()
        (ids_a, meta_a), (ids_b, meta_b) = run_together(sched, prompts, 3, ignore_eos=True)
        assert ids_a == expected(prompts[0], 3) and ids_b == expected(prompts[1], 3)
        # whichever the client threads queued first computes the prefix, the other finds it cached
        assert sorted((meta_a["cached_tokens"], meta_b["cached_tokens"])) == [0, hit], (meta_a, meta_b)
    sched.shutdown()


def test_a_prefix_waited_for_is_shared_as_soon_as_its_chunk_is_through():
    """Each prefill chunk's full pages go to the prefix cache at once: a prompt waiting for a 40-token prefix that a
    60-token prompt computes in 16-token chunks is admitted once the chunk through token 48 is done, and is prefilled
    in the same round as that prompt's last chunk (before its first decode step), finding the 40 tokens cached."""
    runner = FakeRunner(pages_per_seq=16, num_pages=40)
    calls = []
    prefill, launch = runner.prefill, runner.launch
    runner.prefill = lambda state, slot, tokens, *a, **kw: (calls.append(("prefill", slot)),
                                                             prefill(state, slot, tokens, *a, **kw))[1]
    runner.launch = lambda state, active: (calls.append(("launch", None)), launch(state, active))[1]
    sched = Scheduler(runner, FakeTokenizer(), context_length=64, vocab_size=V, chunked_prefill_size=16,
                      overlap_schedule=False)
    sched.start()
    shared = [i % 20 + 1 for i in range(40)]
    long, short = shared + list(range(1, 21)), shared + [7, 8]
    results = {}
    sched.pause_generation("in_place")
    threads = []
    for n, (name, prompt) in enumerate((("long", long), ("short", short))):  # the long one queued first
        threads.append(threading.Thread(target=lambda k=name, p=prompt: results.__setitem__(
            k, run(sched, p, 3, ignore_eos=True))))
        threads[-1].start()
        while sched.stats()["num_waiting_reqs"] < n + 1:
            time.sleep(0.002)
    sched.continue_generation()
    for t in threads:
        t.join(30)
    assert len(results) == 2
    assert results["long"][0] == expected(long, 3) and results["short"][0] == expected(short, 3)
    assert (results["long"][1]["cached_tokens"], results["short"][1]["cached_tokens"]) == (0, 40)
    assert [c for c in calls if c[0] == "prefill"][:5] == [("prefill", 0)] * 4 + [("prefill", 1)], calls
    assert calls.index(("prefill", 1)) < calls.index(("launch", None)), calls
    sched.shutdown()


@pytest.mark.parametrize("policy", [None, PriorityPolicy()])
def test_a_request_waiting_for_a_prefill_keeps_its_rank(policy):
    """A waiting request that waits for a prefill of its prefix lets the requests of its rank after it go first,
    never one of a lower rank (with priority scheduling; without it every request has one rank). Driven by hand:
    the scheduler's thread is not started."""
    sched = Scheduler(FakeRunner(pages_per_seq=16, num_pages=40), FakeTokenizer(), context_length=64,
                      vocab_size=V, chunked_prefill_size=8, priority=policy)
    shared = [i % 20 + 1 for i in range(40)]
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    sched.submit(shared + [3], sp, lambda ev: None, priority=5)
    sched._drain(False)
    sched._admit()  # the first prompt is admitted: its prefill takes several 8-token rounds
    for prompt, priority in ((shared + [7], 5), ([9, 9, 9], 1), ([8, 8, 8], 5)):
        sched.submit(prompt, sp, lambda ev: None, priority=priority)
    sched._drain(False)
    sched._admit()
    running = sorted(r.prompt_ids[-1] for r in sched.slots if r is not None)
    assert running == ([3, 8] if policy is not None else [3, 8, 9]), running  # the one sharing the prefix waits
