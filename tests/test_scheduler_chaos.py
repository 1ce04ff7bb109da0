"""Randomized ("chaos") runs of the scheduler against the fake runner of tests/test_server_scheduler.py (greedy: the
next token is the previous + 1). Client threads submit requests with shared prefixes, random budgets and priorities
to a small page pool, so that requests are retracted for pages and preempted by priority; they abort some of their
requests by rid or by group and continue others in sessions (``serve.sessions``, a ``replace`` aborting a running
parent), while a controller pauses and continues generation in every mode, flushes the cache and releases and resumes
memory occupation. The oracle: every request gets exactly one final event and nothing after it; a request nothing
aborted gets exactly the fake model's tokens and finishes on its length (or its stop token), whatever was retracted or
preempted; an aborted one gets a prefix of them and says abort; once idle no page is held, lost or freed twice, the
runner holds no slot, and the counters agree with what the clients saw. Each run ends with a release of every memory
tag on the idle server and a shutdown with requests in flight."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np
import pytest
from test_server_scheduler import BAD_TOKEN, FakeRunner, expected, make, wait_idle

from specjax.serve import scheduler as scheduler_lib
from specjax.serve.budget import TokenRatio
from specjax.serve.request import Request, RequestError, SamplingParams
from specjax.serve.scheduler import PriorityPolicy
from specjax.serve.sessions import Session, SessionParams

CONTEXT = 28  # ``make``'s context length: a prompt and its output fit in it
WAIT = 20.0  # seconds a request may take to finish before the test calls it a hang
CLIENTS, PER_CLIENT, OUTSTANDING = 4, 12, 4  # 48 requests, at most 16 in flight (4 slots)
STEP_S = 0.001  # a fake step's time: requests overlap, and the controller acts while they run
POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")


class ChaosRunner(FakeRunner):
    """The fake runner, with weights that can be released (``release_memory_occupation``): a prefill or a step
    while they are released fails (and fails its requests, which the oracle catches)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.weights_out = False

    def release_weights(self):
        self.weights_out = True

    def resume_weights(self):
        self.weights_out = False

    def prefill(self, state, *a, **kw):
        assert not self.weights_out, "prefill with the weights released"
        return super().prefill(state, *a, **kw)

    def launch(self, state, active):
        assert not self.weights_out, "decode step with the weights released"
        time.sleep(STEP_S)
        return super().launch(state, active)


@dataclasses.dataclass
class Job:
    """One submitted request and what its sink saw (the sink runs on the scheduler thread)."""
    rid: str
    prompt: list[int]
    n: int
    epoch: int  # the controller's abort-pause epoch when it was submitted (odd: a pause with mode abort runs)
    clock: Callable[[], int]  # reads the epoch
    stop: int | None = None  # a stop token id
    ids: list = dataclasses.field(default_factory=list)
    meta: dict | None = None
    late: int = 0  # events after the final one (a second final one included)
    end_epoch: int = -1
    may_abort: bool = False  # aborted by its client (by rid, group or a session's replace) or the controller
    submitted: bool = False  # ``submit`` returned: an abort from now on reaches it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    req: Request | None = None

    def sink(self, ev: dict) -> None:
        """The request's events: tokens until the final one; anything after it is counted (``late``)."""
        if self.done.is_set():
            self.late += 1
            return
        self.ids += ev["token_ids"]
        if ev["finished"]:
            self.meta, self.end_epoch = ev["meta_info"], self.clock()
            self.done.set()

    def want(self) -> tuple[list[int], dict]:
        """The fake model's tokens and finish reason."""
        out = expected(self.prompt, self.n)
        if self.stop in out:
            return out[:out.index(self.stop) + 1], {"type": "stop", "matched": self.stop}
        return out, {"type": "length", "length": self.n}

    def abort_allowed(self) -> bool:
        """Whether something aborted it: its client, or a pause with mode abort while it was in flight."""
        return self.may_abort or self.epoch % 2 == 1 or self.end_epoch != self.epoch


def budget(prompt: list[int], most: int) -> int:
    """At most ``most`` new tokens, within the context, none of them the fake tokenizer's bad token (0 when the first
    would be: a prefill-only request)."""
    n = max(min(most, CONTEXT - len(prompt)), 0)
    while n and BAD_TOKEN in expected(prompt, n):
        n -= 1
    return n


class Chaos:
    """The clients, the controller and the oracle of one randomized run."""

    def __init__(self, sched, runner, seed: int):
        self.sched, self.runner, self.seed = sched, runner, seed
        self.epoch = 0
        self.jobs: list[Job] = []
        self.by_rid: dict[str, Job] = {}
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        rng = np.random.default_rng(seed)
        self.prefixes = [[int(x) for x in rng.integers(0, 30, k)] for k in (4, 8, 11)]
        self.actions = dict.fromkeys(("in_place", "retract", "abort", "flush", "release", "refused", "session",
                                      "replace", "frozen_abort", "retracted"), 0)
        retract = sched._retract  # every retraction: for pages, for a higher priority, by a pause
        sched._retract = lambda req: (self.count("retracted"), retract(req))[1]

    def count(self, action: str, n: int = 1) -> None:
        """``actions[action] += n`` from any thread."""
        with self.lock:
            self.actions[action] += n

    # ---- clients --------------------------------------------------------------------------------------------------
    def client(self, c: int) -> None:
        """Client ``c``: PER_CLIENT requests, at most OUTSTANDING in flight at once, a few of them aborted by rid or
        by its group (``g<c>``) right after a submission; its failures go to ``errors``."""
        try:
            rng = np.random.default_rng([self.seed, c])
            session, mine = Session(f"s{c}", 1 << 20), []
            for i in range(PER_CLIENT):
                mine = [j for j in mine if not j.done.is_set()]
                while len(mine) >= OUTSTANDING:
                    assert mine[0].done.wait(WAIT), f"request {mine[0].rid} hangs"
                    mine = [j for j in mine if not j.done.is_set()]
                mine.append(self.submit(c, i, rng, session))
                r = rng.random()
                if r < 0.06:  # abort one of its requests in flight (waiting or running) by its rid
                    victim = mine[int(rng.integers(len(mine)))]
                    victim.may_abort = True
                    self.sched.abort(victim.rid)
                elif r < 0.075:  # or all of them by the group they were submitted under
                    for j in mine:
                        j.may_abort = True
                    self.sched.abort(f"g{c}")
                time.sleep(float(rng.choice([0, 0.004, 0.01, 0.02])))
            for j in mine:
                assert j.done.wait(WAIT), f"request {j.rid} hangs"
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            self.errors.append(e)

    def submit(self, c: int, i: int, rng, session: Session) -> Job:
        """A request of client ``c``: a continuation of one of its session's requests (a running one replaced) or
        a fresh prompt over a shared prefix; recorded in the session."""
        sp, parent = self.session_params(session, rng), None
        tail = [int(x) for x in rng.integers(0, 30, int(rng.integers(1, 4 if sp else 7)))]
        if sp is not None:
            prompt, parent = session.prompt(sp, tail, None)
            if len(prompt) > CONTEXT - 2:  # no room left in the context: a fresh prompt instead
                sp, parent = None, None
        if sp is None:
            sp = SessionParams(id=session.id)
            shared = self.prefixes[int(rng.integers(len(self.prefixes)))] if rng.random() < 0.7 else []
            prompt = shared + tail
        if parent is not None:
            self.count("replace" if sp.replace else "session")
        if sp.replace:  # the parent, if still running, and its continuations are aborted
            self.mark_subtree(parent)
        n = budget(prompt, int(rng.integers(0, 21)) if rng.random() < 0.05 else int(rng.integers(1, 21)))
        prio = [None, 0, 5, 20, 30][int(rng.integers(5))]
        stop = [int(t) for t in expected(prompt, n)[2:]] if rng.random() < 0.2 else []  # a stop inside a step
        with self.lock:
            job = Job(f"{self.seed}-{c}-{i}", prompt, n, self.epoch, lambda: self.epoch,
                      stop=stop[int(rng.integers(len(stop)))] if stop else None)
            self.jobs.append(job)
            self.by_rid[job.rid] = job
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[job.stop] if job.stop is not None else [])
        job.req = self.sched.submit(prompt, params, job.sink, rid=job.rid, group=f"g{c}", priority=prio)
        job.submitted = True
        session.recorder(sp, parent, self.sched.abort)(job.req)
        return job

    @staticmethod
    def session_params(session: Session, rng) -> SessionParams | None:
        """A quarter of the time, continue a request of the session (sometimes its prompt only, or its first
        ``offset`` tokens): a finished one, or replace a running one."""
        if rng.random() > 0.25 or not session.nodes:
            return None
        rid = list(session.nodes)[int(rng.integers(len(session.nodes)))]
        running = not session.nodes[rid].req.finished
        if running and rng.random() < 0.6:  # replaced a third of the time, else a fresh prompt
            return None
        return SessionParams(id=session.id, rid=rid, replace=running or None,
                             drop_previous_output=bool(rng.random() < 0.2) or None,
                             offset=int(rng.integers(1, 20)) if rng.random() < 0.15 else None)

    def mark_subtree(self, node) -> None:
        """A session node's request and its continuations may be aborted (a ``replace`` of it)."""
        stack = [node] if node is not None else []
        while stack:
            n = stack.pop()
            self.by_rid[n.req.rid].may_abort = True
            stack.extend(n.children)

    # ---- the controller -------------------------------------------------------------------------------------------
    def control(self, threads, rng) -> None:
        """Until the clients are done: now and then pause generation (each mode) and continue it, flush the cache,
        try to release memory occupation; each snapshot of the stats consistent. Until some request has been
        retracted, a snapshot showing requests running is followed by a retracting pause."""
        while any(t.is_alive() for t in threads):
            time.sleep(float(rng.uniform(0.001, 0.006)))
            st = self.sched.stats()
            check_snapshot(st)
            a = rng.random()
            if st["num_running_reqs"] and not self.actions["retracted"]:
                self.pause("retract", rng)
            elif a < 0.12:
                self.pause("in_place", rng)
            elif a < 0.22:
                self.pause("retract", rng)
            elif a < 0.223 and not self.actions["abort"]:  # once at most: it aborts all that is in flight
                self.pause("abort", rng)
            elif a < 0.32:
                self.count("flush", self.sched.flush_cache())
            elif a < 0.40:
                self.release(rng)

    def pause(self, mode: str, rng) -> None:
        """A pause: after a retracting or aborting one no request holds a page, and the cache can be flushed; an
        aborting one has finished every request in flight."""
        sched = self.sched
        with self.lock:
            before = [j for j in self.jobs if j.submitted]  # queued before the pause: an abort pause ends them all
        self.epoch += mode == "abort"  # odd while a pause may abort what is in flight
        try:
            sched.pause_generation(mode)
        finally:
            self.epoch += mode == "abort"
        if mode == "abort":
            assert all(j.done.is_set() for j in before), [j.rid for j in before if not j.done.is_set()]
        try:
            st = sched.stats()
            assert st["generation_paused"], st
            check_snapshot(st)
            if mode == "in_place" and rng.random() < 0.5:
                self.abort_frozen(rng)
            if mode != "in_place":
                assert st["num_running_reqs"] == 0 and st["kv_pages_used"] == 0, st
                assert sched.flush_cache(), f"flush_cache refused in a pause with mode {mode}"
                st = sched.stats()
                assert st["kv_pages_free"] == st["kv_pages_total"] and st["kv_pages_cached"] == 0, st
            time.sleep(float(rng.uniform(0, 0.01)))
        finally:
            sched.continue_generation()
        self.count(mode)

    def abort_frozen(self, rng) -> None:
        """In an in-place pause nothing runs: a request in flight (running or waiting) that an abort names then
        finishes with an abort, before generation goes on."""
        with self.lock:
            live = [j for j in self.jobs if j.submitted and not j.done.is_set()]
        if not live:
            return
        job = live[int(rng.integers(len(live)))]
        job.may_abort = True
        self.sched.abort(job.rid)
        assert job.done.wait(WAIT), f"{job.rid}, aborted in a pause, never finished"
        assert job.meta["finish_reason"]["type"] == "abort", (job.rid, job.meta)
        self.count("frozen_abort")

    def release(self, rng) -> None:
        """Release memory occupation: refused unless the server is idle; requests submitted meanwhile wait."""
        tags = [None, ["kv_cache"], ["weights"], ["kv_cache", "cuda_graph"]][int(rng.integers(4))]
        try:
            self.sched.release_memory_occupation(tags)
        except RequestError as e:
            assert "idle" in str(e), e
            self.count("refused")
            return
        try:
            st = self.sched.stats()
            assert st["memory_released"] and st["num_running_reqs"] == 0, st
            time.sleep(float(rng.uniform(0, 0.01)))
        finally:
            self.sched.resume_memory_occupation()
        assert self.sched.stats()["memory_released"] == [] and not self.runner.weights_out
        self.count("release")

    # ---- the oracle -----------------------------------------------------------------------------------------------
    def check_jobs(self) -> int:
        """Each request's events against the fake model; returns how many were aborted."""
        aborted = 0
        for j in self.jobs:
            assert j.done.is_set() and j.late == 0, f"{j.rid}: finished {j.done.is_set()}, {j.late} events after"
            reason, (want, finish) = j.meta["finish_reason"], j.want()
            assert (j.meta["id"], j.meta["prompt_tokens"], j.meta["completion_tokens"]) == \
                (j.rid, len(j.prompt), len(j.ids)), (j.meta, j.ids)
            if reason["type"] == "abort":
                full = reason.get("status_code") == 503  # --max-queued-requests: the newcomer or a lower priority
                assert j.abort_allowed() or full, f"{j.rid} aborted though nothing aborted it: {reason}"
                assert reason["message"] != "The request queue is full." or j.ids == [], (j.rid, j.ids)
                assert j.ids == want[:len(j.ids)], (j.rid, j.prompt, j.n, j.ids)
                aborted += 1
            else:
                assert reason == finish and j.ids == want, \
                    (j.rid, j.prompt, j.n, j.ids, reason)
        return aborted


def check_snapshot(st: dict) -> None:
    """A stats snapshot taken at any time: no negative count, pages within the pool."""
    for k, v in st.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            assert v >= 0, (k, v, st)
    total = st["kv_pages_total"]
    assert st["kv_pages_used"] <= total and st["kv_pages_free"] + st["kv_pages_cached"] <= total, st
    assert st["num_running_reqs"] <= st["max_running_requests"] and st["finished"] <= st["requests"], st


def check_idle(sched, runner) -> dict:
    """Once idle: no page held, lost or freed twice; no slot held in the runner; no prefix locked; a flush frees
    every page."""
    st = wait_idle(sched)
    check_snapshot(st)
    assert st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0, st
    assert st["kv_pages_used"] == 0 and st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"], st
    free, rows, refs = sched.call(lambda: (list(sched.pool._free), dict(sched.state["rows"]),
                                           [n.ref for n in sched.radix._walk()]))
    assert len(set(free)) == len(free) and 0 not in free, f"a page freed twice or the scratch page freed: {free}"
    assert rows == {} and not any(refs), (rows, refs)
    assert sched.flush_cache()
    assert sorted(sched.call(lambda: list(sched.pool._free))) == list(range(1, runner.num_pages))
    return st


def release_while_idle(sched, runner) -> None:
    """Every memory tag released on an idle server: a request submitted meanwhile waits (a second release is refused
    while it does) and, resumed, gets its tokens."""
    sched.release_memory_occupation()
    assert runner.weights_out and sched.stats()["kv_pages_free"] == sched.stats()["kv_pages_total"]
    job = Job("after-release", [1, 2, 3], 6, 0, lambda: 0)
    sched.submit(job.prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), job.sink,
                 rid=job.rid)
    deadline = time.monotonic() + WAIT
    while sched.stats()["num_waiting_reqs"] != 1:
        assert time.monotonic() < deadline, "the request never showed as waiting"
        time.sleep(0.01)
    with pytest.raises(RequestError, match="idle"):
        sched.release_memory_occupation(["kv_cache"])
    assert not job.done.is_set()
    sched.resume_memory_occupation()
    assert job.done.wait(WAIT) and job.ids == expected([1, 2, 3], 6) and job.meta["finish_reason"]["type"] == "length"
    check_idle(sched, runner)


def shutdown_busy(sched) -> None:
    """A shutdown with requests running (a step in flight) and waiting: each gets exactly one final event, an abort
    (or its whole output, if it finished first), and a later submit is refused."""
    jobs = [Job(f"last-{i}", [i + 1, i + 2], 20, 0, lambda: 0) for i in range(8)]
    for j in jobs:
        sched.submit(j.prompt, SamplingParams(max_new_tokens=j.n, temperature=0.0, ignore_eos=True), j.sink,
                     rid=j.rid)
    deadline = time.monotonic() + WAIT
    while not any(j.ids for j in jobs):
        assert time.monotonic() < deadline, "no request started"
        time.sleep(0.001)
    sched.shutdown()
    for j in jobs:
        assert j.done.wait(WAIT) and j.late == 0, (j.rid, j.late)
        want, finish = j.want()
        assert j.meta["finish_reason"]["type"] == "abort" or j.meta["finish_reason"] == finish, j.meta
        assert j.ids == want[:len(j.ids)], (j.rid, j.ids)
    with pytest.raises(RuntimeError, match="shut down"):
        sched.submit([1], SamplingParams(max_new_tokens=1), print)


def chaos_run(config: int, w: int, overlap: bool, seed: int) -> tuple[Chaos, dict]:
    """One randomized run (``seed``) on scheduler configuration ``config`` (0-3: the schedule policy, priority
    scheduling on even ones, the chunk size, optimistic admission on 1 and 2, the stream interval, a bounded queue
    on 2, no prefix cache on 3), checked throughout; (the run, the stats once it is idle)."""
    runner = ChaosRunner(tokens_per_step=w)
    optimistic = TokenRatio.of(env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1"})  # admits more: more retraction
    sched = make(runner, chunked_prefill_size=(5, 3, None, 8)[config], overlap_schedule=overlap,
                 schedule_policy=POLICIES[config], priority=(PriorityPolicy(low_values_first=config == 0), None,
                                                             PriorityPolicy(), None)[config],
                 token_ratio=optimistic if config in (1, 2) else None, stream_interval=(1, 3, 1, 2)[config],
                 max_queued=8 if config == 2 else None, enable_radix_cache=config != 3)
    try:
        chaos = Chaos(sched, runner, seed)
        threads = [threading.Thread(target=chaos.client, args=(c,), daemon=True) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        chaos.control(threads, np.random.default_rng([seed, 99]))
        for t in threads:
            t.join(WAIT)
        assert not chaos.errors and not any(t.is_alive() for t in threads), chaos.errors
        aborted = chaos.check_jobs()
        st = check_idle(sched, runner)
        assert st["requests"] == st["finished"] == len(chaos.jobs) == CLIENTS * PER_CLIENT, st
        assert st["aborted"] == aborted and st["generated_tokens"] == sum(len(j.ids) for j in chaos.jobs), st
        release_while_idle(sched, runner)
        shutdown_busy(sched)
        return chaos, st
    finally:
        sched.shutdown()


@pytest.mark.parametrize("w,overlap", [(1, True), (1, False), (3, True), (3, False)])
@pytest.mark.parametrize("seed", range(4))
def test_random_clients_aborts_pauses_and_releases_keep_every_request_whole(seed, w, overlap, monkeypatch):
    """48 random requests from 4 client threads through 11 pages of 4 tokens (4 slots, 28-token context), with
    aborts, session continuations, pauses of each mode, cache flushes and memory releases: every request finishes
    once with the fake model's exact tokens (a prefix of them when aborted), and the pool drains back whole. Seeds
    pick the scheduler's configuration (``chaos_run``) and GROW_PAGES (4, or none beyond the next steps' pages)."""
    monkeypatch.setattr(scheduler_lib, "GROW_PAGES", (4, 4, 0, 0)[seed])
    chaos, st = chaos_run(seed, w, overlap, seed * 10 + w * 2 + overlap)
    assert chaos.actions["retracted"] > 0, ("nothing was retracted: the run missed what it is for", chaos.actions)


@pytest.mark.parametrize("page_size,num_pages", [(1, 29), (4, 8)])
def test_a_request_holding_its_prefix_twice_is_retracted_not_aborted(page_size, num_pages):
    """Found by ``chaos_run`` on pools of 1-token pages: two requests sharing an 8-token prefix are prefilled in one
    round; the second finds the first's pages cached by then and locks them, keeping its own copy too. Alone after
    the first finishes, it holds that prefix twice, and with a pool that holds its prompt and output once the pool
    runs dry under it: it is retracted (and comes back on the cached pages alone) rather than aborted as too large
    for the pool."""
    runner = FakeRunner(max_batch=2, page_size=page_size, pages_per_seq=32 // page_size, num_pages=num_pages)
    sched = make(runner, overlap_schedule=False,  # admission counts one output token each: both run at once
                 token_ratio=TokenRatio.of(env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1"}))
    try:
        shared = [1, 2, 3, 4, 5, 6, 7, 8]
        jobs = [Job("short", shared + [20], 1, 0, lambda: 0), Job("long", shared + [25], 18, 0, lambda: 0)]
        sched.pause_generation("in_place")  # both wait, then are admitted and prefilled in one iteration
        for j in jobs:
            sched.submit(j.prompt, SamplingParams(max_new_tokens=j.n, temperature=0.0, ignore_eos=True), j.sink,
                         rid=j.rid)
        while sched.stats()["num_waiting_reqs"] < 2:
            time.sleep(0.002)
        sched.continue_generation()
        for j in jobs:
            assert j.done.wait(WAIT) and (j.ids, j.meta["finish_reason"]) == j.want(), (j.rid, j.ids, j.meta)
        assert runner.prefix_checks > 0 and check_idle(sched, runner)["retracted"] == 1
    finally:
        sched.shutdown()
