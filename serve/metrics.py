"""Prometheus metrics (``--enable-metrics``): request and token counters, latency histograms, queue length, KV usage,
generation throughput and, with speculative decoding, the accept length. Names follow SGLang's ``sglang:`` family with
a ``specjax:`` prefix. Disabled metrics still keep the throughput window used by /get_server_info."""

from __future__ import annotations

import collections
import threading
import time

THROUGHPUT_WINDOW_S = 10.0


class Metrics:
    def __init__(self, enabled: bool = False, model_name: str = ""):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._window: collections.deque = collections.deque()  # (time, generated tokens) per decode step
        self._window_tokens = 0  # their sum (read every scheduler iteration: no walk over the window)
        if not enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        lab = {"labelnames": ["model_name"], "registry": self.registry}
        self._name = model_name
        self.requests = Counter("specjax:num_requests", "requests received", **lab)
        self.finished = Counter("specjax:num_finished_requests", "requests finished (any reason)", **lab)
        self.aborted = Counter("specjax:num_aborted_requests", "requests aborted or failed", **lab)
        self.prompt_tokens = Counter("specjax:prompt_tokens", "prompt tokens computed (not cached)", **lab)
        self.cached_tokens = Counter("specjax:cached_tokens", "prompt tokens reused from the radix cache", **lab)
        self.generation_tokens = Counter("specjax:generation_tokens", "tokens generated", **lab)
        self.running = Gauge("specjax:num_running_reqs", "requests in the running batch", **lab)
        self.queue = Gauge("specjax:num_queue_reqs", "requests waiting for a slot or KV pages", **lab)
        self.kv_usage = Gauge("specjax:token_usage", "fraction of KV pages held by running requests", **lab)
        self.kv_cached = Gauge("specjax:cached_pages", "KV pages held by the radix cache", **lab)
        self.gen_throughput = Gauge("specjax:gen_throughput", "generated tokens/s over the last 10 s", **lab)
        self.accept = Gauge("specjax:spec_accept_length", "mean tokens per speculative verify step", **lab)
        self.retracted = Counter("specjax:num_retracted_requests", "running requests retracted to the queue when "
                                 "the KV pool ran out of pages", **lab)
        self.token_ratio = Gauge("specjax:new_token_ratio", "the share of their remaining token budgets that "
                                 "admission expects running requests to still emit", **lab)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))
        self.ttft = Histogram("specjax:time_to_first_token_seconds", "time to first token", buckets=buckets, **lab)
        self.e2e = Histogram("specjax:e2e_request_latency_seconds", "end-to-end latency", buckets=buckets, **lab)
        self.itl = Histogram("specjax:inter_token_latency_seconds", "decode step time per generated token",
                             buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, float("inf")), **lab)

    def _l(self, m):
        return m.labels(model_name=self._name)

    def on_arrival(self) -> None:
        if self.enabled:
            self._l(self.requests).inc()

    def on_prefill(self, computed: int, cached: int) -> None:
        if self.enabled:
            self._l(self.prompt_tokens).inc(computed)
            self._l(self.cached_tokens).inc(cached)

    def on_generated(self, tokens: int) -> None:
        """Tokens added to requests' outputs (the prefill's first token included, tokens past a stop not)."""
        if self.enabled and tokens:
            self._l(self.generation_tokens).inc(tokens)

    def on_step(self, tokens: int, batch: int, seconds: float) -> None:
        """A decode step that gave ``batch`` requests ``tokens`` output tokens in ``seconds``."""
        now = time.monotonic()
        with self._lock:
            self._window.append((now, tokens))
            self._window_tokens += tokens
            self._prune(now)
        if self.enabled and tokens:
            self._l(self.itl).observe(seconds * batch / tokens)

    def on_retract(self, n: int) -> None:
        if self.enabled and n:
            self._l(self.retracted).inc(n)

    def on_finish(self, req, meta: dict) -> None:
        if not self.enabled:
            return
        self._l(self.finished).inc()
        if (req.finish_reason or {}).get("type") == "abort":
            self._l(self.aborted).inc()
        self._l(self.e2e).observe(meta["e2e_latency"])
        if req.first_token_time is not None:
            self._l(self.ttft).observe(req.first_token_time - req.arrival)

    def _prune(self, now: float) -> None:
        while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
            self._window_tokens -= self._window.popleft()[1]

    def throughput(self) -> float:
        """Generated tokens per second over the last ``THROUGHPUT_WINDOW_S`` seconds of decode steps."""
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            if not self._window:
                return 0.0
            return self._window_tokens / max(now - self._window[0][0], 1e-3)

    def set_gauges(self, snap: dict) -> None:
        if not self.enabled:
            return
        self._l(self.running).set(snap["num_running_reqs"])
        self._l(self.queue).set(snap["num_waiting_reqs"])
        self._l(self.kv_usage).set(snap["kv_usage"])
        self._l(self.kv_cached).set(snap["kv_pages_cached"])
        self._l(self.gen_throughput).set(snap["gen_throughput"])
        self._l(self.token_ratio).set(snap["new_token_ratio"])
        if "avg_spec_accept_length" in snap:
            self._l(self.accept).set(snap["avg_spec_accept_length"])

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
