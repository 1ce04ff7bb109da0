"""The scheduler: one thread that owns the model runner, the KV pages and the radix cache.

Every iteration it (1) takes new requests, aborts and control calls from its inbox, (2) admits waiting requests into
free slots when their prompt's KV pages and their output (4,096 tokens of it at most) fit beside what the running
requests are expected to emit (SGLang's new-token ratio, ``budget.TokenRatio``; unreferenced cached prefixes are evicted
if needed), (3) spends up to ``chunked_prefill_size`` prompt tokens on prefill, and (4) gives every slot that has
finished its prefill the pages of its next step (retracting requests to the queue when the pool runs dry) and runs one
decode step (plain or speculative) for them. Requests join and leave between steps (continuous batching). Output events
go to each request's sink as they are produced. With the overlap schedule (the default, as SGLang's) step (4) launches
this iteration's step and only then collects the previous one, so emitting tokens, detokenizing and finishing requests
run while the device computes; a request that finished in the collected step has run one more step, whose tokens are
dropped (its pages cover two steps past what the host has collected). Nothing here raises out of the loop: a failing
request is finished with an abort reason, and a failing batch step fails the running batch and resets the device state.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import numbers
import queue
import sys
import threading
import time
import uuid
from typing import Any, Callable

import jax
import numpy as np

from .budget import TokenRatio
from .metrics import Metrics
from .pages import PagePool, RadixCache
from .profiler import Profiler
from .request import NO_LIMIT, Request, RequestError, SamplingParams, token_ids
from .runners.base import Launched
from .watchdog import Watchdog

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's release_memory_occupation tags (no CUDA graphs here)
WEIGHTS_RELEASED = "the weights are released (release_memory_occupation): resume them first"
GROW_PAGES = 4  # pages a growing request takes beyond its next steps' when the pool has them free
IN_BATCH_PREFIX_TOKENS = 32  # a prefix shared with a prefill in progress worth waiting for (SGLang's 32 tokens)
IN_BATCH_PREFIX_CHECKS = 128  # waiting requests checked for it per admission pass (SGLang's LPM stops at 128 too)


@dataclasses.dataclass(frozen=True)
class PriorityPolicy:
    """SGLang's priority scheduling (``--enable-priority-scheduling``): waiting requests are admitted by priority
    (larger values first, or smaller with ``low_values_first``), then by the schedule policy; one that finds no
    room retracts running requests whose priority is lower by more than ``preemption_threshold``. Requests that
    give no priority get ``default``, else the lowest priority there is (as SGLang)."""
    low_values_first: bool = False
    preemption_threshold: int = 10
    default: int | None = None

    @classmethod
    def of(cls, args) -> "PriorityPolicy | None":
        """The policy of ServerArgs ``args`` (None unless priority scheduling is on)."""
        if not args.enable_priority_scheduling:
            return None
        return cls(args.schedule_low_priority_values_first, args.priority_scheduling_preemption_threshold,
                   args.default_priority_value)

    def rank(self, priority: int) -> int:
        """Larger ranks are admitted first."""
        return -priority if self.low_values_first else priority

    def unset(self) -> int:
        """The priority of a request that gives none."""
        if self.default is not None:
            return self.default
        return sys.maxsize if self.low_values_first else -sys.maxsize - 1


log = logging.getLogger("specjax.serve")


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of token lists ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n == 0 or a[0] != b[0]:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _row(logprobs, b: int):
    """Slot ``b``'s part of a runner's ``logprobs`` (None stays None, and so does an array not read)."""
    return None if logprobs is None else tuple(None if a is None else a[b] for a in logprobs)


@dataclasses.dataclass
class _Inflight:
    """A launched step: the runner's handle, the request each slot held at launch (None: not in the step), when."""
    launched: Launched
    reqs: list[Request | None]
    t0: float


class Scheduler:
    def __init__(self, runner, tokenizer, *, context_length: int, vocab_size: int, eos_ids=(),
                 chunked_prefill_size: int | None = 512, enable_radix_cache: bool = True,
                 schedule_policy: str = "fcfs", random_seed: int = 0, spec: bool = False,
                 metrics: Metrics | None = None, overlap_schedule: bool = True,
                 priority: PriorityPolicy | None = None, refuse_priority: bool = False,
                 max_queued: int | None = None, stream_interval: int = 1, log_requests: int | None = None,
                 token_ratio: TokenRatio | None = None, max_prefill_tokens: int | None = None,
                 decode_log_interval: int = 40, watchdog: Watchdog | None = None, auto_truncate: bool = False):
        self.runner, self.tokenizer = runner, tokenizer
        self.auto_truncate = auto_truncate  # SGLang's --allow-auto-truncate: max_new_tokens lowered to fit the pool
        self.context_length, self.vocab_size = context_length, vocab_size
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        # the prompt tokens of one prefill round over all requests: the smaller of the two limits, as SGLang
        self.round_budget = min(self.chunk or float("inf"), max_prefill_tokens or float("inf"))
        self.decode_log_interval = decode_log_interval  # SGLang's: a "Decode batch." line every N steps (0: none)
        self._decode_steps = 0
        self.watchdog = watchdog  # SGLang's --watchdog-timeout: times each iteration's work
        self.policy, self.spec, self.overlap, self.priority = schedule_policy, spec, overlap_schedule, priority
        self.refuse_priority, self.max_queued, self.stream_interval = refuse_priority, max_queued, stream_interval
        self.log_requests = log_requests  # SGLang's --log-requests-level when --log-requests, else None
        self.ratio = token_ratio or TokenRatio.of()  # the running requests' expected growth, for admission
        self.page_size = runner.page_size
        self.pool = PagePool(runner.num_pages)
        self.radix = RadixCache(self.pool, self.page_size, enabled=enable_radix_cache)
        self.metrics = metrics or Metrics(enabled=False)
        self.profiler = Profiler()  # SGLang's /start_profile: a jax.profiler trace over forward steps
        self._rng = np.random.default_rng(random_seed)
        self._order_rng = np.random.default_rng(random_seed)  # --schedule-policy random (apart from the seeds')
        self.admission_paused = False  # set on this thread (``call``): waiting requests wait (a weight update)
        self.generation_paused = False  # SGLang's pause_generation: no admission, prefill or step until continued
        self.memory_released: set[str] = set()  # SGLang's release_memory_occupation tags now released
        self._inbox: queue.Queue = queue.Queue()
        self.waiting: list[Request] = []
        self.slots: list[Request | None] = [None] * runner.max_batch
        self.state = runner.init_state()
        self._pending: _Inflight | None = None  # the step launched last iteration, not collected yet
        self._last_collect = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot: dict[str, Any] = {}
        self._live: dict[str, Request] = {}  # rid -> its request, from submit until finished (any thread reads it)
        self._live_lock = threading.Lock()
        self.totals = {"requests": 0, "finished": 0, "aborted": 0, "retracted": 0, "prompt_tokens": 0,
                       "generated_tokens": 0, "cached_tokens": 0, "spec_verify_ct": 0, "spec_tokens": 0}
        self._update_snapshot()

    # ---- thread-safe API -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="specjax-scheduler", daemon=True)
        self._thread.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def max_new_tokens_cap(self, prompt_len: int) -> int:
        return self.context_length - prompt_len

    def max_prompt_len(self) -> int:
        """SGLang's max_req_input_len: the longest prompt served, with room for one output token in the context and
        in the KV pool (with the pages a step in flight may write)."""
        return min(self.context_length, self._most_tokens_in_pool()) - 1

    def _most_tokens_in_pool(self) -> int:
        """The longest sequence whose pages (``_pages_for``) the whole pool holds."""
        if self._pages_for(self.context_length) <= self.pool.capacity:
            return self.context_length
        return self.pool.capacity * self.page_size - self._step_reach()

    def submit(self, prompt_ids, params: SamplingParams, sink: Callable[[dict], None], rid: str | None = None,
               seed: int | None = None, group: str | None = None, priority: int | None = None) -> Request:
        """Validate and queue a request; raises RequestError when it can never be served as asked, or when ``rid``
        names a request still in flight. ``group``: the client's rid of a request submitted under an expanded rid
        (a batch or n copies), which an abort names as well; ``priority``: SGLang's (``PriorityPolicy``)."""
        priority = self._priority_of(priority)
        # The length first: a prompt of millions of ids is refused at once, not after Python passes over each id on
        # the caller's thread (the server's event loop, which /health shares).
        n = len(prompt_ids) if isinstance(prompt_ids, (list, tuple, np.ndarray)) else 0
        if n >= self.context_length:
            raise RequestError(f"the prompt has {n} tokens but the context length is {self.context_length} "
                               f"(prompt + output must fit); shorten the prompt", param="prompt",
                               code="context_length_exceeded")
        ids = token_ids(prompt_ids)  # integers only: a float or a string id is refused, never truncated
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="input_ids")
        try:
            params.runner_row(0, self.eos_ids).validate(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split(" ")[0]) from None
        params.max_new_tokens = min(params.max_new_tokens, self.max_new_tokens_cap(len(ids)))
        if self.auto_truncate:  # lowered to what the pool holds, as SGLang caps it at max_req_len
            most = self._most_tokens_in_pool()
            fits = max(most - len(ids), 1)
            if params.max_new_tokens > fits and params.max_new_tokens != NO_LIMIT:
                log.warning("max_new_tokens %d lowered to %d: the KV pool holds %d tokens of this request "
                            "(--allow-auto-truncate)", params.max_new_tokens, fits, most)
            params.max_new_tokens = min(params.max_new_tokens, fits)
        need = self._pages_for(len(ids) + params.max_new_tokens)
        if need > self.pool.capacity:
            raise RequestError(f"the request needs {need} KV pages ({need * self.page_size} tokens: prompt "
                               f"{len(ids)} + max_new_tokens {params.max_new_tokens}) but the KV pool holds "
                               f"{self.pool.capacity}; lower max_tokens or raise --max-total-tokens",
                               param="max_tokens", code="kv_pool_too_small")
        if seed is None:
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2 ** 31 - 1))
        req = Request(rid=rid or uuid.uuid4().hex, prompt_ids=ids, params=params, sink=sink, seed=int(seed),
                      group=group, priority=priority)
        with self._live_lock:  # an abort names a rid: two requests under one would both be aborted (SGLang refuses)
            if self._stop.is_set():  # nothing would ever answer it (the loop fails what it holds when it stops)
                raise RuntimeError("the scheduler is shut down: start a new engine / server")
            if req.rid in self._live:
                raise RequestError(f"a request with rid {req.rid!r} is already in flight; give each request its own "
                                   f"rid", param="rid", code="duplicate_rid")
            self._live[req.rid] = req
        self._inbox.put(("req", req))
        return req

    def _priority_of(self, priority) -> int:
        """A request's priority: the one it gives (an integer), else the policy's ``unset``. Without priority
        scheduling a given one is ignored, as SGLang does, or refused with ``refuse_priority``
        (``--abort-on-priority-when-disabled``)."""
        if self.priority is None:
            if priority is not None and self.refuse_priority:
                raise RequestError("this server does not schedule by priority (it was started without "
                                   "--enable-priority-scheduling): send the request without one", param="priority")
            return 0
        if priority is None:
            return self.priority.unset()
        if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
            raise RequestError(f"priority must be an integer, got {priority!r}", param="priority")
        return int(priority)

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the scheduler thread between iterations and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._live_lock:  # as ``submit``: a stopped loop never answers (``_fail_live`` fails what got in before)
            if self._stop.is_set():
                raise RuntimeError("the scheduler is shut down: start a new engine / server")
            self._inbox.put(("call", fn, fut))
        return fut.result(timeout)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are running, or waiting while generation goes
        on (a retracting pause leaves them waiting: then the cache may be flushed, as SGLang allows)."""
        def do():
            if any(self.slots) or (self.waiting and not self.generation_paused):
                return False
            self.radix.evict(self.pool.capacity)
            self._update_snapshot()
            return True
        return self.call(do)

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's: stop admitting, prefilling and stepping until ``continue_generation``, after the step in flight
        is collected. ``abort``: every running and waiting request finishes with an abort first; ``retract``: the
        running requests leave their slots and K/V (``_retract``) and wait, to be prefilled again over their prompt
        and output when generation continues (the cache can be flushed, the weights updated meanwhile);
        ``in_place``: they stay as they are (slots, K/V) and go on where they stopped. Requests submitted meanwhile
        wait."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)}", param="mode")

        def do():
            self._collect_pending()
            running = [r for r in self.slots if r is not None]
            if mode == "abort":
                self._abort_all(self.waiting + running, "aborted by pause_generation")
            elif mode == "retract":
                self._retract_all(running)
            self.generation_paused = True
            self._update_snapshot()
        self.call(do, timeout=3600.0)  # an iteration may compile or prefill a long chunk first

    def continue_generation(self) -> None:
        """Resume after ``pause_generation``: the paused and the waiting requests go on."""
        def do():
            self.generation_paused = False
            self._update_snapshot()
        self.call(do, timeout=3600.0)

    def release_memory_occupation(self, tags=None) -> None:
        """SGLang's: free the device memory of the weights (kept in host memory) and / or the KV pool (``tags``,
        default all) while the server is idle, for a trainer sharing the device; requests wait until
        ``resume_memory_occupation``. A RequestError while requests run or wait, or for a tag already released."""
        tags = self._memory_tags(tags)

        def do():
            self._collect_pending()  # a step launched before the last request finished
            if any(self.slots) or self.waiting:
                raise RequestError("release_memory_occupation needs an idle server: requests are running or "
                                   "waiting (let them finish, or /pause_generation with mode abort)", "tags")
            again = sorted((tags & self.memory_released) - {"cuda_graph"})
            if again:
                raise RequestError(f"{', '.join(again)} already released", "tags")
            if "weights" in tags:  # first: a failure here (host memory) leaves the KV pool as it was
                self.runner.release_weights()
                self.memory_released.add("weights")
            if "kv_cache" in tags:
                self.radix.reset()
                self.pool.reset()
                state, self.state = self.state, None
                self.memory_released.add("kv_cache")
                for x in jax.tree.leaves(state):
                    if isinstance(x, jax.Array):
                        x.delete()
            self.memory_released |= tags & {"cuda_graph"}
            self._update_snapshot()
        self.call(do, timeout=3600.0)

    def resume_memory_occupation(self, tags=None) -> None:
        """SGLang's: the released weights back on the device as they were, a fresh KV pool (the prefix cache
        starts empty); waiting requests go on once nothing is released. ``tags`` None: whatever is released. A
        RequestError for a tag not released."""
        given = None if tags is None else self._memory_tags(tags)

        def do():
            want = set(self.memory_released) if given is None else given
            missing = sorted((want - self.memory_released) - {"cuda_graph"})
            if missing:
                raise RequestError(f"{', '.join(missing)} not released", "tags")
            if "weights" in want and "weights" in self.memory_released:
                self.runner.resume_weights()
                self.memory_released.discard("weights")
            if "kv_cache" in want and "kv_cache" in self.memory_released:
                self.state = self.runner.init_state()
                self.memory_released.discard("kv_cache")
            self.memory_released -= want
            self._update_snapshot()
        self.call(do, timeout=3600.0)

    @property
    def weights_released(self) -> bool:
        return "weights" in self.memory_released

    def _held(self) -> bool:
        """Nothing runs: generation paused, or weights or KV pool released."""
        return self.generation_paused or bool(self.memory_released - {"cuda_graph"})

    @staticmethod
    def _memory_tags(tags) -> set[str]:
        tags = set(MEMORY_TAGS if tags is None else [tags] if isinstance(tags, str) else tags)
        bad = sorted(tags - set(MEMORY_TAGS))
        if bad:
            raise RequestError(f"unknown memory tag {bad[0]!r}; choose from {', '.join(MEMORY_TAGS)}", "tags")
        return tags

    def set_target_params(self, params, flush_cache: bool = True) -> None:
        """(On this thread, ``call``, with no request running.) The runner's target weights replaced; the cached
        prefixes, K/V of the old weights, dropped unless ``flush_cache`` is False."""
        if self.weights_released:
            raise RuntimeError(WEIGHTS_RELEASED)
        self.runner.set_target_params(params)
        if flush_cache:
            self.radix.evict(self.pool.capacity)
        self._update_snapshot()

    def drained(self) -> bool:
        """(On this thread, ``call``.) No request holds a slot and no step is in flight."""
        return not any(self.slots) and self._pending is None

    def stats(self) -> dict[str, Any]:
        """The state at the end of the loop's last iteration (read without waiting for the loop): a request's
        first tokens can reach its client before the iteration that admitted it ends, and a finished request's
        last event before the state shows it gone. Each state is whole: a request counted ``finished`` is out of
        ``num_running_reqs`` and its pages are free or cached."""
        return dict(self._snapshot)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            ran = False  # a forward step (SGLang's count, for /start_profile's start_step and num_steps)
            try:
                drained = self.drained()
                idle = self._held() or ((not self.waiting or self.admission_paused) and drained)
                if not self.waiting and drained:
                    self.ratio.reset()  # as SGLang: an idle server admits the next requests from the initial ratio
                self._drain(block=idle)
                if self._stop.is_set():
                    break
                if self._held():  # (a call just drained may have paused or released)
                    continue
                if self.watchdog is not None:
                    self.watchdog.begin()
                self._admit()
                steps = self._decode_steps
                ran = self._prefill_round()
                self._decode_round()
                ran = ran or self._decode_steps != steps
                self._update_snapshot()
            except Exception:  # noqa: BLE001 - the scheduler must never die
                log.exception("scheduler iteration failed; failing the running batch and resetting device state")
                self._recover("internal error in the scheduler")
            finally:
                if self.watchdog is not None:
                    self.watchdog.end()
            if ran:  # outside the watchdog's time: stopping a trace writes it (never raises)
                self.profiler.on_step()
        self._fail_live("the scheduler shut down")

    def _fail_live(self, message: str) -> None:
        """Finish every request still in flight with an abort, so that no consumer waits forever (``submit``
        refuses new ones once ``_stop`` is set, under the same lock)."""
        with self._live_lock:
            live = list(self._live.values())
            while True:  # calls queued before the stop: answered with the refusal, never left waiting
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "call":
                    item[2].set_exception(RuntimeError("the scheduler is shut down: start a new engine / server"))
        self._abort_all(live, message)

    def _abort_all(self, reqs, message: str) -> None:
        """Finish each of ``reqs`` (waiting or running) with an abort; one that fails does not stop the others."""
        gone = {id(r) for r in reqs}
        self.waiting = [r for r in self.waiting if id(r) not in gone]
        for req in reqs:
            try:
                self._finish(req, {"type": "abort", "message": message})
            except Exception:  # noqa: BLE001 - the others must still hear it
                log.exception("while aborting request %s", req.rid)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self._update_snapshot()
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        kind = item[0]
        if kind == "req":
            req = item[1]
            self.totals["requests"] += 1
            self.metrics.on_arrival()
            try:
                req.init_detok()
            except Exception as e:  # noqa: BLE001 - answered, never left waiting
                log.exception("request %s could not be queued", req.rid)
                self._finish(req, {"type": "abort", "message": f"{type(e).__name__}: {e}"})
                return
            if self._queue_full_for(req):
                return
            self.waiting.append(req)
        elif kind == "abort":
            rid = item[1]
            named = lambda r: r is not None and rid in (r.rid, r.group)  # noqa: E731
            for req in list(self.waiting):
                if named(req):
                    self.waiting.remove(req)
                    self._finish(req, {"type": "abort", "message": "aborted by the client"})
            for req in self.slots:
                if named(req):
                    self._finish(req, {"type": "abort", "message": "aborted by the client"})
        elif kind == "call":
            _, fn, fut = item
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

    def _queue_full_for(self, req: Request) -> bool:
        """SGLang's ``--max-queued-requests``: with the queue full, the newcomer is refused (503), or with priority
        scheduling the least preferred waiting request (the lowest priority, the latest among equals) when the
        newcomer's priority is higher. True when the newcomer was refused."""
        if self.max_queued is None or len(self.waiting) < self.max_queued:
            return False
        victim = req
        if self.priority is not None:
            rank = self.priority.rank
            worst = min(self.waiting, key=lambda r: (rank(r.priority), -r.arrival))
            if rank(req.priority) > rank(worst.priority):
                victim = worst
                self.waiting.remove(worst)
        message = "The request queue is full." if victim is req else \
            "The request is aborted by a higher priority request."  # SGLang's messages
        self._finish(victim, {"type": "abort", "message": message, "status_code": 503})
        return victim is req

    # ---- admission -----------------------------------------------------------------------------------------------
    def _step_reach(self) -> int:
        """Positions past a request's tokens that steps may write before the host sees them: a step's
        tokens_per_step and, overlapped, one more step's."""
        return self.runner.tokens_per_step * (2 if self.overlap else 1)

    def _pages_for(self, length: int) -> int:
        """The pages a request of ``length`` tokens holds, with the positions steps in flight may write
        (``_step_reach``)."""
        tokens = length + self._step_reach()
        return min(-(-tokens // self.page_size), self.runner.pages_per_seq)

    def _room(self, matched, without=()) -> float:
        """The KV tokens a newcomer whose cached prefix is ``matched`` may count on: free pages, evictable ones but
        its own prefix's, and the pages only ``without`` (running requests to be retracted) hold, less what the
        other running requests are expected to still write past the pages they hold (``budget.TokenRatio``)."""
        pages = self.pool.num_free + self.radix.evictable_pages() - sum(n.ref == 0 for n in matched)
        growth = sum(self._growth(r) for r in self.slots if r is not None)
        return pages * self.page_size - growth + sum(self._freed_by(r) for r in without)

    def _growth(self, req: Request) -> float:
        """KV tokens ``req`` is expected to write past the pages it holds."""
        return max(self._expected(req) - self._headroom(req), 0.0)

    def _freed_by(self, req: Request) -> float:
        """What retracting running ``req`` adds to ``_room``: its pages no other request shares, and its growth."""
        return (len(req.pages) - sum(n.ref > 1 for n in req.nodes)) * self.page_size + self._growth(req)

    def _cost(self, req: Request, need: int) -> int:
        """The KV tokens a newcomer takes in SGLang's admission: the ``need`` pages of its prompt and its whole
        remaining output (at most ``clip`` tokens of it; only the running requests' outputs are scaled by the
        ratio)."""
        return need * self.page_size + self.ratio.counted(req.params.max_new_tokens - len(req.output_ids))

    def _expected(self, req: Request) -> float:
        """The output tokens ``req`` is expected to still emit (``budget.TokenRatio``)."""
        return self.ratio.expected(req.params.max_new_tokens - len(req.output_ids))

    def _headroom(self, req: Request) -> int:
        """Positions past its tokens that the pages ``req`` holds cover."""
        return len(req.pages) * self.page_size - len(req.prompt_ids) - len(req.output_ids)

    def _admit(self) -> None:
        full = all(s is not None for s in self.slots)
        if self.admission_paused or not self.waiting or (full and not self._may_preempt()):
            return
        order = list(self.waiting)
        if self.policy == "lpm" and self.radix.enabled:
            z = self.page_size
            order.sort(key=lambda r: -len(self.radix.match(r.fill_ids, (r.fill_len - 1) // z)))
        elif self.policy == "dfs-weight" and self.radix.enabled:
            z = self.page_size
            last = [(self.radix.match(r.fill_ids, (r.fill_len - 1) // z) or [None])[-1] for r in order]
            order = [order[i] for i in self.radix.dfs_weight_order(last)]
        elif self.policy == "lof":  # longest output first: the largest token budget, then arrival
            order.sort(key=lambda r: -r.params.max_new_tokens)
        elif self.policy == "random":
            order = [order[i] for i in self._order_rng.permutation(len(order))]
        if self.priority is not None:  # stable: the policy's order within a priority
            order.sort(key=lambda r: -self.priority.rank(r.priority))
        prefilling = [r for r in self.slots if r is not None and not r.prefill_done]
        waited = None  # the rank of the first request that waits for a prefill: none of a lower rank passes it
        for i, req in enumerate(order):
            rank = self.priority.rank(req.priority) if self.priority is not None else 0
            if waited is not None and rank < waited:
                return
            if i < IN_BATCH_PREFIX_CHECKS and self._waits_for_prefill(req, prefilling):
                waited = rank if waited is None else waited
                continue  # admitted once that prefix is cached (SGLang's in-batch prefix caching); the requests
            if self._admit_one(req):  # after it, of its rank, may go first meanwhile
                prefilling.append(req)
                continue
            if self.priority is not None and self._preempt_for(req):
                self._admit_one(req)  # then stop: the retracted requests rank above the rest of ``order``
            return  # wait for running requests to finish (no overtaking: keeps the order fair)

    def _waits_for_prefill(self, req: Request, prefilling) -> bool:
        """Whether ``req`` shares at least ``IN_BATCH_PREFIX_TOKENS`` tokens of whole pages with a request still being
        prefilled (``prefilling``), not all of them cached yet: it waits until the chunks of that prefill that
        compute them are through (each chunk's full pages go to the cache, ``_prefill_chunk``), instead of
        computing the same prefix again and holding it in pages of its own twice (SGLang defers such requests within
        a batch)."""
        if not prefilling or not self.radix.enabled:
            return False
        z, fill = self.page_size, req.fill_ids
        most = (len(fill) - 1) // z  # whole pages a prefill may find cached (the last token is computed)
        for r in prefilling:
            key = (r.rid, r.arrival)  # (a finished request's rid may come again)
            shared = req.shared_with.get(key)
            if shared is None:  # once per pair: neither fill changes while one waits and the other prefills
                shared = req.shared_with[key] = _common_prefix(fill, r.fill_ids, most * z) // z
            if shared * z >= IN_BATCH_PREFIX_TOKENS and shared > len(r.nodes):  # r's first pages in the cache
                return True
        return False

    def _may_preempt(self) -> bool:
        """With priority scheduling, whether a waiting request outranks a running one by more than the threshold
        (else a full batch admits nothing: no sorting or trie walks every step)."""
        if self.priority is None:
            return False
        rank = self.priority.rank
        low = min((rank(r.priority) for r in self.slots if r is not None), default=None)
        best = max(rank(r.priority) for r in self.waiting)
        return low is not None and best - low > self.priority.preemption_threshold

    def _admit_one(self, req: Request) -> bool:
        """Give ``req`` a slot and the pages its prompt needs (what the prefix cache lacks; its output's pages come
        as it grows, ``_grow``); False when there is no free slot, or no room for the prompt and its output
        (``_cost``) beside what the running requests are expected to emit (``_room``)."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        if not free:
            return False
        nodes, need = self._prefix_and_need(req)
        if any(self.slots) and self._cost(req, need) > self._room(nodes):
            return False  # beside the running requests' expected growth (alone, it always fits: ``submit``)
        self.radix.lock(nodes)
        if self.pool.num_free < need:
            self.radix.evict(need - self.pool.num_free)
        fresh = self.pool.alloc(need)
        if fresh is None:
            self.radix.unlock(nodes)
            return False
        self.waiting.remove(req)
        req.nodes = list(nodes)
        req.pages = [n.page for n in nodes] + fresh
        req.prefilled = req.prefill_from = len(nodes) * self.page_size
        req.shared_with.clear()
        if not req.admitted:  # a retracted request keeps the count of prompt tokens it found cached at first
            req.cached_tokens, req.admitted = req.prefilled, True
            self.totals["cached_tokens"] += req.cached_tokens
        req.slot = free[0]  # lowest free slot: keeps the running batch packed for bucketed decode
        self.slots[req.slot] = req
        return True

    def _prefix_and_need(self, req: Request) -> tuple[list, int]:
        """(the cached prefix's radix nodes, the further pages ``req`` needs for the rest of its fill)."""
        fill = req.fill_ids
        nodes = self.radix.match(fill, (len(fill) - 1) // self.page_size)
        return nodes, self._pages_for(len(fill)) - len(nodes)

    def _preempt_for(self, req: Request) -> bool:
        """SGLang's priority preemption: running requests whose priority is below ``req``'s by more than the
        threshold, the lowest first (among equals the latest to arrive), are retracted (``_retract``) when together
        they free a slot and the pages ``req`` needs; True when some were."""
        rank, limit = self.priority.rank, self.priority.preemption_threshold
        cands = sorted((r for r in self.slots if r is not None and not r.finished
                        and rank(req.priority) - rank(r.priority) > limit),
                       key=lambda r: (rank(r.priority), -r.arrival))
        if not cands:  # the common case while the batch is full: no trie walks
            return False
        matched, need = self._prefix_and_need(req)
        cost = self._cost(req, need)
        slot_free, chosen, room = None in self.slots, [], self._room(matched)
        for r in cands:
            if slot_free and cost <= room:
                break
            chosen.append(r)
            room += self._freed_by(r)
            slot_free = True
        if not chosen or cost > room:
            return False
        self._collect_pending()  # the step in flight first: its tokens and sampling state belong to them
        chosen = [r for r in chosen if r.slot is not None and self.slots[r.slot] is r and not r.finished]
        self._retract_all(chosen)
        if chosen:
            log.info("retracted %d request(s) of a lower priority for request %s", len(chosen), req.rid)
        return bool(chosen)

    def _page_row(self, req: Request) -> np.ndarray:
        row = np.zeros((self.runner.pages_per_seq,), np.int32)  # 0 = scratch page
        row[:len(req.pages)] = req.pages
        return row

    # ---- prefill -------------------------------------------------------------------------------------------------
    def _prefill_round(self) -> bool:
        """Within the round's token budget (the smaller of ``--chunked-prefill-size`` and ``--max-prefill-tokens``,
        over all requests), prefill the admitted prompts' next chunks, then score the chunks of those that ask for
        prompt logprobs; a request whose prompt is through both emits its first token and joins the decode steps.
        True when some prompt tokens were prefilled."""
        budget = self.round_budget
        fresh = cached = spent = 0  # SGLang's "Prefill batch." line: requests whose prefill began, cached tokens
        for req in [r for r in self.slots if r is not None and not r.decoding]:
            if budget <= 0:
                break
            if req.finished or req.slot is None:  # failed with the batch (``_recover``) earlier in this round
                continue
            if not req.prefill_done:
                n = int(min(req.fill_len - req.prefilled, budget))
                hit = req.prefill_from  # the cached prefix it began from
                if not self._prefill_chunk(req, n):
                    continue
                began = req.prefilled - n == hit
                fresh, cached, spent, budget = fresh + began, cached + began * hit, spent + n, budget - n
                if not req.prefill_done:
                    continue
            begin, end = req.score_span()
            left = end - begin - req.scored
            if left > 0:
                c = int(min(left, budget))
                if c <= 0 or not self._score_chunk(req, begin + req.scored, c):
                    continue
                budget -= c
                if c < left:
                    continue
            self._first_token(req, req.first_token)
        if spent and log.isEnabledFor(logging.INFO):
            log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, %s", fresh, spent, cached,
                     self._usage_line())
        return spent > 0

    def _prefill_chunk(self, req: Request, n: int) -> bool:
        """Prefill the request's next ``n`` prompt tokens; False when that failed (the request, or the batch when
        the device state was lost, is finished)."""
        try:
            row = req.saved_row if req.saved_row is not None else req.params.runner_row(req.seed, self.eos_ids)
            self.state, tok = self.runner.prefill(self.state, req.slot, np.asarray(
                req.fill_ids[:req.prefilled + n], np.int32), self._page_row(req), row, cached=req.prefilled)
        except Exception as e:  # noqa: BLE001
            log.exception("prefill of request %s failed", req.rid)
            if self._state_lost():
                self._recover(f"prefill failed: {type(e).__name__}: {e}")
            else:
                self._finish(req, {"type": "abort", "message": f"prefill failed: {type(e).__name__}: {e}"},
                             cache_ok=False)
            return False
        req.prefilled += n
        self.totals["prompt_tokens"] += n
        if req.prefill_done:
            req.first_token, req.saved_row = tok, None  # the row lives in the slot again
            if req.params.return_logprob and not req.resumed:  # the first prompt token asked for, without a
                # logprob; scores follow it (a retracted request has its prompt's already)
                begin, end = req.score_span()
                req.input_logprobs = [(None, req.prompt_ids[begin if end > begin else -1], None, None)]
            if not req.prompt_counted:  # a prompt's prefill once (not again after a retraction)
                req.prompt_counted = True
                self.metrics.on_prefill(len(req.prompt_ids) - req.cached_tokens, req.cached_tokens)
        self._cache_prefix(req)  # chunk by chunk: a request waiting for this prefix (``_waits_for_prefill``) goes
        return True  # on once the chunk that computes it is through

    def _score_chunk(self, req: Request, begin: int, count: int) -> bool:
        """Score prompt positions [begin, begin + count) of a prefilled request (its prompt logprobs); False when
        that failed (the request is finished)."""
        try:
            req.input_logprobs += self.runner.score_prompt(self.state, self._page_row(req), req.prompt_ids, begin,
                                                           count, req.params.temperature,
                                                           req.params.token_ids_logprob or ())
        except Exception as e:  # noqa: BLE001 - fail this request only
            log.exception("prompt logprobs of request %s failed", req.rid)
            self._finish(req, {"type": "abort", "message": f"logprobs failed: {type(e).__name__}: {e}"})
            return False
        return True

    # ---- decode --------------------------------------------------------------------------------------------------
    def _decode_round(self) -> None:
        """Give the running requests the pages the next step may write (``_grow``), launch it, then collect the one
        launched last iteration. A step is collected before the next launch when the pages for both are not there
        (the pool short, or a context-capped request near its end), and then requests are retracted
        (``_retract_for_pages``) if the pool is still short; a step is collected at once when one of its requests
        asks for logprobs (they are read from the state it leaves)."""
        pending, self._pending = self._pending, None
        w = self.runner.tokens_per_step
        if pending is not None and not self._grow(2 * w, may_pass_cap=False):
            self._collect(pending)
            pending = None
        if pending is None and not self._grow(w):
            self._retract_for_pages()
        elif any(r is not None and r.decoding for r in self.slots):
            self.ratio.step()
        ok, launched = self._launch(pending)
        if not ok or (pending is not None and not self._collect(pending)):
            return  # the state was reset: the running batch failed, steps in flight with it
        if launched is not None:
            if self.overlap and not any(r is not None and r.params.return_logprob for r in launched.reqs):
                self._pending = launched
            else:
                self._collect(launched)

    def _collect_pending(self) -> None:
        """Collect the step in flight now (before requests leave their slots outside a step's collection)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._collect(pending)

    def _grow(self, reach: int, may_pass_cap: bool = True) -> bool:
        """Give every decoding request the pages for ``reach`` positions past its tokens (a few more, within the
        output expected of it, when the pool has them free or cached: page tables change every few pages, not every
        page), evicting cached prefixes if needed; False, with nothing handed out, when the pool cannot. A
        request's pages stop at the page table's width: False where ``reach`` passes it, unless ``may_pass_cap`` (a
        step writes nothing there)."""
        z, cap, short = self.page_size, self.runner.pages_per_seq, []
        for r in self.slots:
            if r is None or not r.decoding or r.finished:
                continue
            length = len(r.prompt_ids) + len(r.output_ids)
            need = -(-(length + reach) // z)
            if need > cap and not may_pass_cap:
                return False
            if min(need, cap) > len(r.pages):  # and beyond it, up to GROW_PAGES more within its expected growth
                most = min(self._pages_for(length + int(self._expected(r))), need + GROW_PAGES, cap)
                short.append((r, min(need, cap) - len(r.pages), max(most - len(r.pages), 0)))
        if not short:
            return True
        must, nice = sum(s[1] for s in short), sum(max(s[1], s[2]) for s in short)
        if self.pool.num_free < nice:  # cached prefixes make way for the slack too
            self.radix.evict(nice - self.pool.num_free)
        if self.pool.num_free < must:
            return False
        roomy = self.pool.num_free >= nice
        for r, n_must, n_nice in short:
            r.pages += self.pool.alloc(max(n_nice, n_must) if roomy else n_must)
        self.state = self.runner.set_page_rows(self.state, {r.slot: self._page_row(r) for r, _, _ in short})
        return True

    def _retract_for_pages(self) -> None:
        """SGLang's retract_decode: the pool cannot give every decoding request the pages of its next step, so
        decoding requests are retracted (``_retract_all``) until it can: the one with the fewest output tokens
        first, among equals the longest prompt (with priority scheduling the lowest priority before all); requests
        still prefilling (the latest admitted first) only when one decoding request is left, and that one last only
        when it holds a prefix twice (``_holds_copies``). The token ratio then becomes what the remaining decoding
        requests have shown (``budget.TokenRatio.after_retraction``)."""
        rank = self.priority.rank if self.priority is not None else (lambda p: 0)
        running = [r for r in self.slots if r is not None and not r.finished]
        decoding = sorted((r for r in running if r.decoding), reverse=True,
                          key=lambda r: (rank(r.priority), len(r.output_ids), -len(r.prompt_ids)))
        prefilling = sorted((r for r in running if not r.decoding), key=lambda r: r.arrival)

        def victims():  # the caller's ``_grow`` has just failed
            while True:
                if len(decoding) <= 1 and not prefilling:
                    if decoding and self._holds_copies(decoding[0]):  # retracted, it comes back without the copies
                        yield decoding.pop()
                        return
                    self._abort_all(decoding, "the KV pool cannot hold this request")  # never: ``submit`` refuses
                    return  # what the pool cannot hold
                yield decoding.pop() if len(decoding) > 1 else prefilling.pop()
                if self._grow(self.runner.tokens_per_step):
                    return
        retracted = self._retract_all(victims())
        left = [r for r in self.slots if r is not None and r.decoding]
        before = self.ratio.value
        self.ratio.after_retraction(sum(len(r.output_ids) for r in left),
                                    sum(r.params.max_new_tokens for r in left), len(left))
        self.totals["retracted"] += len(retracted)
        self.metrics.on_retract(len(retracted))
        log.info("KV pool full: retracted %d request(s), %d running; new token ratio %.4f -> %.4f", len(retracted),
                 len(left), before, self.ratio.value)

    @staticmethod
    def _holds_copies(req: Request) -> bool:
        """Whether ``req`` holds prefix-cache pages outside its page row: a request that prefilled a prefix another
        cached first keeps its own copy and locks the cached one (``_cache_prefix``), so that prefix takes its pages
        twice; retracted and admitted again, it holds the cached pages alone."""
        own = set(req.pages)
        return any(n.page not in own for n in req.nodes)

    def _launch(self, pending: _Inflight | None = None) -> tuple[bool, _Inflight | None]:
        """Launch a step of every running request, except one that the step in flight (``pending``) finishes for
        certain (it emits at least one token: one left in the budget)."""
        def runs(b, r):
            if r is None or not r.decoding or r.finished:
                return False
            return pending is None or pending.reqs[b] is not r or len(r.output_ids) + 1 < r.params.max_new_tokens
        active = np.array([runs(b, r) for b, r in enumerate(self.slots)])
        if not active.any():
            return True, None
        t0 = time.perf_counter()
        try:
            self.state, launched = self.runner.launch(self.state, active)
        except Exception as e:  # noqa: BLE001
            log.exception("decode step failed")
            self._recover(f"decode step failed: {type(e).__name__}: {e}")
            return False, None
        return True, _Inflight(launched, [r if a else None for r, a in zip(self.slots, active)], t0)

    def _collect(self, inflight: _Inflight) -> bool:
        """Emit a launched step's tokens to the requests still in the slots it ran (one that finished or left
        since its launch gets nothing). False when the step failed (the batch is failed and the state reset)."""
        reqs = inflight.reqs
        keep = np.array([r is not None and self.slots[b] is r and not r.finished for b, r in enumerate(reqs)])
        try:
            tokens, counts = self.runner.collect(inflight.launched, keep)
        except Exception as e:  # noqa: BLE001
            log.exception("decode step failed")
            self._recover(f"decode step failed: {type(e).__name__}: {e}")
            return False
        rows = np.nonzero(keep)[0]
        lps = self._logprobs([reqs[b] for b in rows])
        n_out = 0  # tokens the requests received (a step's tokens past a stop are dropped)
        for b in rows:
            req = reqs[b]
            req.spec_verify_ct += 1
            c = int(counts[b])
            if self.spec:
                self.totals["spec_tokens"] += c
                req.spec_draft_tokens += inflight.launched.drafts
                req.spec_accepted += max(c - 1, 0)  # a step gives its accepted drafts and one token of its own
            n_out += self._emit_tokens(req, tokens[b, :c].tolist(), _row(lps, b))
        now = time.perf_counter()
        self.metrics.on_step(n_out, len(rows), now - max(inflight.t0, self._last_collect))
        self._last_collect = now
        if self.spec:
            self.totals["spec_verify_ct"] += len(rows)
        self._decode_steps += 1
        if self.decode_log_interval and self._decode_steps % self.decode_log_interval == 0 and \
                log.isEnabledFor(logging.INFO):
            spec = self.totals["spec_tokens"] / max(self.totals["spec_verify_ct"], 1) if self.spec else None
            log.info("Decode batch. %s, gen throughput (token/s): %.2f%s", self._usage_line(),
                     self.metrics.throughput(), "" if spec is None else f", accept len: {spec:.2f}")
        return True

    def _held_pages(self) -> int:
        """Pages held by running requests (neither free nor evictable)."""
        return self.pool.capacity - self.pool.num_free - self.radix.evictable_pages()

    def _usage_line(self) -> str:
        """SGLang's batch-log fields: the running requests, the KV tokens they hold and that share of the pool,
        the waiting requests (and the new-token ratio admission uses)."""
        held = self._held_pages()
        running = sum(r is not None for r in self.slots)
        return (f"#running-req: {running}, #token: {held * self.page_size}, token usage: "
                f"{held / max(self.pool.capacity, 1):.2f}, #queue-req: {len(self.waiting)}, new token ratio: "
                f"{self.ratio.value:.4f}")

    def _first_token(self, req: Request, tok: int) -> None:
        """Emit the prefill's token (with the prompt's logprobs when asked for). As SGLang: prompt tokens from
        ``logprob_start_len`` on (-1, the default: the last prompt token only, which runs no scoring program), the
        first of them without a logprob (None). A request for 0 new tokens (SGLang's prefill-only request) finishes
        here, its token unused (the logprobs of its ``token_ids_logprob`` after the prompt kept, as SGLang's
        scoring reads them)."""
        req.decoding = True
        try:  # the prompt's logprobs are in req.input_logprobs already (``_prefill_chunk``, ``_score_chunk``)
            lps = self._logprobs([req])
        except Exception as e:  # noqa: BLE001 - fail this request only
            log.exception("logprobs of request %s failed", req.rid)
            self._finish(req, {"type": "abort", "message": f"logprobs failed: {type(e).__name__}: {e}"})
            return
        if req.params.max_new_tokens == 0:
            req.record_ids_logprobs(_row(lps, req.slot), 0)
            self._finish(req, {"type": "length", "length": 0})
            return
        self._emit_tokens(req, [tok], _row(lps, req.slot))

    def _logprobs(self, reqs):
        """The runner's logprobs of the latest step (host arrays), fetched only when one of ``reqs`` wants them."""
        if not any(r.params.return_logprob for r in reqs):
            return None
        return self.runner.logprobs(self.state, ids=any(r.params.token_ids_logprob for r in reqs))

    def _emit_tokens(self, req: Request, tokens, logprobs=None) -> int:
        """Append a step's tokens to ``req`` (up to a stop), stream or finish it. Returns how many it took."""
        before = len(req.output_ids)
        try:
            req.append_tokens(tokens, self.tokenizer, self.eos_ids, self.max_new_tokens_cap(len(req.prompt_ids)),
                              logprobs)
            self.totals["generated_tokens"] += len(req.output_ids) - before
            self.metrics.on_generated(len(req.output_ids) - before)
            if req.finished:
                self._finish(req)
            elif req.sent_ids == 0 or len(req.output_ids) - req.sent_ids >= self.stream_interval:
                text, ids = req.stream_delta()  # the first token at once, then every stream_interval tokens
                if text or ids:
                    self._send(req, {"text": text, "token_ids": ids, "finished": False,
                                     "meta_info": req.meta_info(self.spec, self.tokenizer)})
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer failure: fail this request only
            log.exception("output processing of request %s failed", req.rid)
            if not req.finished or req.slot is not None:
                self._finish(req, {"type": "abort", "message": f"{type(e).__name__}: {e}"})
        return len(req.output_ids) - before

    # ---- finishing -----------------------------------------------------------------------------------------------
    def _cache_prefix(self, req: Request) -> None:
        tokens = req.tokens_in_cache()
        if self.spec:
            tokens = tokens[:-1]  # the last position's draft KV depends on the token after it
        full = len(tokens) // self.page_size
        if full > len(req.nodes):
            req.nodes += self.radix.insert(tokens[:full * self.page_size], req.pages, req.nodes)

    def _finish(self, req: Request, reason: dict | None = None, cache_ok: bool = True) -> None:
        with self._live_lock:  # its rid is free again (before its consumer hears that it finished)
            if self._live.get(req.rid) is req:
                del self._live[req.rid]
        if reason is not None and (req.finish_reason is None or reason["type"] == "abort"):
            req.finish_reason = reason
        try:
            req.flush_text(self.tokenizer)
        except Exception:  # noqa: BLE001
            log.exception("final detokenization of %s failed", req.rid)
        text, ids = req.stream_delta()
        self._free_slot(req, cache_ok)
        try:
            meta = req.meta_info(self.spec, self.tokenizer)
        except Exception as e:  # noqa: BLE001 - the consumer gets its final event whatever failed
            log.exception("meta info of request %s failed", req.rid)
            req.finish_reason = {"type": "abort", "message": f"{type(e).__name__}: {e}"}
            meta = {"id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
                    "completion_tokens": len(req.output_ids)}
        self.totals["finished"] += 1
        if req.finish_reason.get("type") == "abort":
            self.totals["aborted"] += 1
        self.metrics.on_finish(req, meta)
        self._send(req, {"text": text, "token_ids": ids, "finished": True, "meta_info": meta})
        if self.log_requests is not None:
            try:
                self._log_request(req, meta)
            except Exception:  # noqa: BLE001 - a log line never fails the scheduler
                log.exception("logging request %s failed", req.rid)

    def _log_request(self, req: Request, meta: dict) -> None:
        """SGLang's --log-requests at a finish: level 0 the request's metadata, 1 its sampling parameters too, 2 its
        prompt and output text too (2048 characters of each), 3 all of them."""
        if not log.isEnabledFor(logging.INFO):
            return
        level, cut = self.log_requests, (lambda t: t if self.log_requests >= 3 else t[:2048])
        keep = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency")
        parts = [f"{k}={meta[k]!r}" for k in keep if k in meta]
        if level >= 1:
            parts.append(f"sampling_params={dataclasses.asdict(req.params)!r}")
        if level >= 2:
            try:
                prompt = self.tokenizer.decode(req.prompt_ids if level >= 3 else req.prompt_ids[:2048])
                if level < 3 and len(prompt) < 2048 < len(req.prompt_ids):  # tokens shorter than a character
                    prompt = self.tokenizer.decode(req.prompt_ids)
                parts.append(f"prompt={cut(prompt)!r}")
            except Exception:  # noqa: BLE001 - a log line never fails a request
                parts.append(f"prompt_ids={cut(str(req.prompt_ids))}")
            parts.append(f"output={cut(req.text)!r}" if self.tokenizer is not None else
                         f"output_ids={cut(str(req.output_ids))}")
        log.info("Finish: %s", ", ".join(parts))

    def _free_slot(self, req: Request, cache_ok: bool = True) -> None:
        """The request leaves its slot: its full pages of K/V go to the prefix cache (``cache_ok``), the rest back
        to the pool."""
        if req.slot is None:
            return
        if cache_ok:
            self._cache_prefix(req)
        self.radix.unlock(req.nodes)
        owned = {n.page for n in req.nodes}
        self.pool.release([p for p in req.pages if p not in owned])
        self.state = self.runner.release(self.state, req.slot)
        self.slots[req.slot] = None
        req.slot, req.nodes, req.pages = None, [], []

    def _retract_all(self, reqs) -> list[Request]:
        """Retract ``reqs`` (running; ``_retract``; an iterable, taken one at a time) back to the queue, ahead of
        what arrived later, in arrival order; returns them."""
        done = []
        try:
            for req in reqs:
                self._retract(req)
                done.append(req)
        finally:  # requeued whatever failed after them (``_recover`` fails only what holds a slot)
            self.waiting = sorted(done, key=lambda r: r.arrival) + self.waiting
        return done

    def _retract(self, req: Request) -> None:
        """SGLang's retraction: the request leaves its slot (its K/V pages to the prefix cache, where its next
        prefill finds what was not evicted meanwhile) and waits to be prefilled again over its prompt and the output
        it emitted, its sampling row kept (the same random stream and penalty state go on). One that has emitted
        nothing starts over as it arrived."""
        if req.decoding:  # its output so far is prefilled again with the prompt (``Request.resumed``)
            req.saved_row = self.runner.slot_row(self.state, req.slot)
        self._free_slot(req)
        req.prefilled, req.decoding, req.first_token = 0, False, None

    def _send(self, req: Request, event: dict) -> None:
        try:
            req.sink(event)
        except Exception:  # noqa: BLE001 - a broken consumer must not hurt the others
            log.exception("sink of request %s failed", req.rid)

    def _state_lost(self) -> bool:
        try:
            return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))
        except Exception:  # noqa: BLE001
            return True

    def _recover(self, message: str) -> None:
        """Fail every running request and start over with fresh device state and an empty prefix cache."""
        for req in list(self.slots):
            if req is not None:
                try:
                    req.finish_reason = {"type": "abort", "message": message}
                    self.radix.unlock(req.nodes)
                    req.nodes, req.pages = [], []
                    self.slots[req.slot] = None
                    req.slot = None
                    self._finish(req)
                except Exception:  # noqa: BLE001
                    log.exception("while failing request %s", req.rid)
        self.slots = [None] * self.runner.max_batch
        self._pending = None
        self.radix.reset()
        self.pool.reset()
        if "kv_cache" in self.memory_released:  # the pool stays freed (resume_memory_occupation makes a new one)
            self._update_snapshot()
            return
        try:
            self.state = self.runner.init_state()
        except Exception:  # noqa: BLE001
            log.exception("re-initialising the device state failed")
        self._update_snapshot()

    # ---- stats ---------------------------------------------------------------------------------------------------
    def _update_snapshot(self) -> None:
        cap = self.pool.capacity
        held = self._held_pages()
        running = [r for r in self.slots if r is not None]
        t = self.totals
        snap = {
            "num_running_reqs": len(running), "num_waiting_reqs": len(self.waiting),
            "kv_pages_total": cap, "kv_pages_used": held, "kv_pages_cached": self.radix.cached_pages(),
            "kv_pages_free": self.pool.num_free, "kv_usage": held / cap if cap else 0.0,
            "page_size": self.page_size, "max_running_requests": self.runner.max_batch,
            "generation_paused": self.generation_paused, "memory_released": sorted(self.memory_released),
            "new_token_ratio": self.ratio.value, **t,
        }
        if self.spec:
            snap["avg_spec_accept_length"] = t["spec_tokens"] / t["spec_verify_ct"] if t["spec_verify_ct"] else 0.0
        snap["gen_throughput"] = self.metrics.throughput()
        self._snapshot = snap
        self.metrics.set_gauges(snap)
