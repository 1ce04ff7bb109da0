"""``specjax.Engine``: the server's scheduler in-process, with SGLang's offline API.

    llm = specjax.Engine(model_path="...", speculative_algorithm="EAGLE3", speculative_draft_model_path="...",
                         speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    out = llm.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
    for chunk in llm.generate("Hi", {"max_new_tokens": 8}, stream=True):
        print(chunk["text"])              # each chunk carries the output so far, as SGLang's (new text only with
                                          # incremental_streaming_output=True)
    out = await llm.async_generate("Hi", {"max_new_tokens": 8})          # in asyncio code; stream=True too
    llm.shutdown()                        # requests still in flight finish with an abort; later calls are refused

Keyword arguments are ServerArgs' fields (the same set as the command line flags, dashes -> underscores).
Like ``python -m specjax.serve``, the Engine keeps its compiled programs in jax's persistent compilation cache
(``hub.enable_compilation_cache``: ``~/.cache/specjax/xla``; ``SPECJAX_COMPILATION_CACHE=0`` turns it off), so the
next process that builds the same Engine loads them instead of compiling them again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from typing import Any, AsyncIterator, Iterator

import numpy as np

from specjax.hub import enable_compilation_cache
from specjax.serve.launch import build, setup_logging

from .args import ServerArgs
from .protocol import GenerateRequest
from .request import (RequestError, SamplingParams, batch_rids, check_text, copy_rid, refuse_unsupported,
                      token_ids, with_logprob_fields)


LOGPROB_ARGS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                "token_ids_logprob")


def _empty_output() -> dict[str, Any]:
    return {"text": "", "output_ids": [], "meta_info": {}}


def _merge(outs: list[dict], i: int, ev: dict) -> int:
    """Add a scheduler event to request ``i``'s output; 1 when it finished it."""
    outs[i]["text"] += ev["text"]
    outs[i]["output_ids"] += ev["token_ids"]
    outs[i]["meta_info"] = ev["meta_info"]
    return int(ev["finished"])


def _chunk(outs: list[dict], i: int, ev: dict, incremental: bool) -> dict:
    """A streamed chunk of request ``i``: its output so far, as SGLang's Engine streams by default (``outs`` holds
    it), or with ``incremental`` the event's new text and token ids only; ``index`` when several requests stream."""
    _merge(outs, i, ev)
    out = outs[i] if not incremental else {"text": ev["text"], "output_ids": ev["token_ids"]}
    chunk = {"text": out["text"], "output_ids": list(out["output_ids"]), "meta_info": ev["meta_info"],
             "finished": ev["finished"]}
    if len(outs) > 1:
        chunk["index"] = i
    return chunk


class Engine:
    def __init__(self, **kwargs):

        kwargs.setdefault("log_level", "warning")
        self.server_args = ServerArgs.from_kwargs(**kwargs).validate()
        setup_logging(self.server_args.log_level)
        enable_compilation_cache()
        self.backend = build(self.server_args)
        self.tokenizer = self.backend.tokenizer
        if not self.server_args.skip_server_warmup:
            self.backend.warmup()

    # ---- inputs --------------------------------------------------------------------------------------------------
    def _prompts(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        """(token ids per prompt, whether one prompt was given rather than a list); a RequestError for a prompt of
        the wrong type, an empty batch or a text no tokenizer takes."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt or input_ids", "prompt")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and not isinstance(prompt, (list, tuple)):
                raise RequestError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}",
                                   "prompt")
            texts = [check_text(t) for t in ([prompt] if single else prompt)]
            prompts = [self.backend.encode(t) for t in texts]
        else:
            single = not isinstance(input_ids, (list, tuple)) or not input_ids or \
                not isinstance(input_ids[0], (list, tuple, np.ndarray))
            prompts = [token_ids(input_ids)] if single else [token_ids(x) for x in input_ids]
        if not prompts:
            raise RequestError("empty batch: no prompt given", "prompt")
        return prompts, single

    def _params(self, sampling_params, prompts, logprobs: dict) -> list[SamplingParams]:
        """One SamplingParams per prompt, with SGLang's request-level logprob fields (``logprobs``) applied; an
        explicit max_new_tokens past the context and a logprob_start_len past the prompt are errors, as over HTTP."""
        many = isinstance(sampling_params, (list, tuple))
        if many and len(sampling_params) != len(prompts):
            raise RequestError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts",
                               "sampling_params")
        given = list(sampling_params) if many else [sampling_params] * len(prompts)
        sps = with_logprob_fields([SamplingParams.from_dict(s) for s in given], **logprobs)
        for ids, d, sp in zip(prompts, given, sps):
            self.backend.check_request(ids, sp, max_new_given=bool(d) and d.get("max_new_tokens") is not None)
        return sps

    def _submit_all(self, prompt, sampling_params, input_ids, sink_for, kwargs: dict):
        """Submit every request (n copies of each prompt); ``kwargs``: SGLang's other generate() arguments."""
        extra = dict(kwargs)
        logprobs = {name: extra.pop(name) for name in LOGPROB_ARGS if name in extra}
        given_rid = extra.pop("rid", None)
        priority = extra.pop("priority", None)
        session_params = extra.pop("session_params", None)
        for name, value in extra.items():  # the features specjax lacks: accepted when they ask for nothing
            if name not in GenerateRequest.UNSUPPORTED:
                raise TypeError(f"Engine.generate() got an unexpected keyword argument {name!r}")
            refuse_unsupported(name, value, GenerateRequest.UNSUPPORTED)
        prompts, single = self._prompts(prompt, input_ids)
        prompts, recorders = self.backend.prepare_prompts(prompts, session_params)
        sps = self._params(sampling_params, prompts, logprobs)
        rids = batch_rids(given_rid, len(prompts))
        reqs = []
        try:
            for k, (ids, sp) in enumerate(zip(prompts, sps)):
                for j in range(sp.n):
                    seed = None if sp.seed is None else sp.seed + j
                    rid, group = copy_rid(given_rid, rids, k, j, sp.n, len(prompts))
                    reqs.append(self.backend.submit(ids, dataclasses.replace(sp), sink_for(len(reqs)), rid=rid,
                                                    seed=seed, group=group, priority=priority))
                    recorders[k](reqs[-1])
        except Exception:
            self._abort(reqs)
            raise
        return reqs, single and len(reqs) == 1

    # ---- API -----------------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False, **kwargs
                 ) -> dict | list[dict] | Iterator[dict]:
        """Returns {text, output_ids, meta_info} for one prompt (n == 1), else a list in prompt order (n copies
        of each prompt in a row). With ``stream=True`` returns an iterator of chunks {text, output_ids, meta_info,
        finished, and index when several requests stream} holding each request's output so far, as SGLang's
        (its new text and token ids only with ``incremental_streaming_output=True``). ``kwargs``: SGLang's ``rid``
        (a string, or one per prompt: the ids ``meta_info.id`` carries; copies of a prompt under one rid get
        ``{rid}-{k}-{j}``), ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
        ``return_text_in_logprobs``, ``token_ids_logprob`` (a value, or one per prompt; they may also sit in
        ``sampling_params``), ``priority`` (with ``enable_priority_scheduling``), ``session_params`` (a mapping, or
        one per prompt: continue a request of a session, ``open_session``), and its
        arguments for features specjax lacks (``image_data``, ``lora_path``, ...), accepted only when they ask for
        nothing."""
        q: queue.Queue = queue.Queue()
        reqs, single = self._submit_all(prompt, sampling_params, input_ids, lambda i: (lambda ev: q.put((i, ev))),
                                        kwargs)
        if stream:
            return self._stream(q, reqs)
        outs = [_empty_output() for _ in reqs]
        done = 0
        try:
            while done < len(reqs):
                done += _merge(outs, *q.get())
        except BaseException:
            self._abort(reqs)
            raise
        return outs[0] if single else outs

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                             **kwargs) -> dict | list[dict] | AsyncIterator[dict]:
        """``generate`` for asyncio code, as SGLang's: ``await llm.async_generate(...)``; with ``stream=True`` it
        returns an async iterator of the same chunks (``async for chunk in await llm.async_generate(...)``). The
        event loop is never blocked: the scheduler thread hands each event to it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        reqs, single = self._submit_all(
            prompt, sampling_params, input_ids,
            lambda i: (lambda ev: loop.call_soon_threadsafe(q.put_nowait, (i, ev))), kwargs)
        if stream:
            return self._astream(q, reqs)
        outs = [_empty_output() for _ in reqs]
        done = 0
        try:
            while done < len(reqs):
                done += _merge(outs, *await q.get())
        except BaseException:  # a cancelled task frees its requests' slots and pages
            self._abort(reqs)
            raise
        return outs[0] if single else outs

    def _stream(self, q: queue.Queue, reqs) -> Iterator[dict]:
        outs, done = [_empty_output() for _ in reqs], 0
        try:
            while done < len(reqs):
                i, ev = q.get()
                done += ev["finished"]
                yield _chunk(outs, i, ev, self.server_args.incremental_streaming_output)
        finally:
            self._abort(reqs)  # no-op for finished ones; frees pages if the caller stopped

    async def _astream(self, q: asyncio.Queue, reqs) -> AsyncIterator[dict]:
        outs, done = [_empty_output() for _ in reqs], 0
        try:
            while done < len(reqs):
                i, ev = await q.get()
                done += ev["finished"]
                yield _chunk(outs, i, ev, self.server_args.incremental_streaming_output)
        finally:
            self._abort(reqs)

    def _abort(self, reqs) -> None:
        for r in reqs:
            self.backend.scheduler.abort(r.rid)

    def score(self, query: str | list[int] | None = None, items: str | list[str] | list[list[int]] | None = None,
              label_token_ids: list[int] | None = None, apply_softmax: bool = False, item_first: bool = False
              ) -> list[list[float]]:
        """SGLang's: per item, the probabilities of ``label_token_ids`` as the next token after query + item (item
        + query with ``item_first``), in the labels' order; with ``apply_softmax`` normalised over the labels
        (``serve.scoring``)."""
        job = self.backend.score_job(query, items, label_token_ids, apply_softmax, item_first)
        for wave in job.waves:  # a wave that failed raises before the next is submitted
            job.record(wave, [o["meta_info"] for o in self.generate(**self._wave_inputs(job, wave))])
        return job.scores

    async def async_score(self, query: str | list[int] | None = None,
                          items: str | list[str] | list[list[int]] | None = None,
                          label_token_ids: list[int] | None = None, apply_softmax: bool = False,
                          item_first: bool = False) -> list[list[float]]:
        """``score`` for asyncio code (the event loop is never blocked)."""
        job = self.backend.score_job(query, items, label_token_ids, apply_softmax, item_first)
        for wave in job.waves:
            job.record(wave, [o["meta_info"] for o in await self.async_generate(**self._wave_inputs(job, wave))])
        return job.scores

    @staticmethod
    def _wave_inputs(job, wave) -> dict:
        """``generate``'s arguments for a scoring wave's items."""
        return dict(input_ids=[job.prompts[i] for i in wave],
                    sampling_params=[dataclasses.asdict(job.params)] * len(wave))

    def flush_cache(self) -> bool:
        return self.backend.scheduler.flush_cache()

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str | None:
        """SGLang's: a new session (``serve.sessions``) and its id, ``session_id`` if given; None when a session
        of that id is open. ``generate(..., session_params={"id": ..., "rid": ...})`` continues its requests."""
        return self.backend.sessions.open(capacity_of_str_len, session_id)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's: free the device memory of the weights (kept in host memory) and / or the KV pool (``tags``:
        ``weights``, ``kv_cache``; default all) while no request runs, e.g. for a trainer in this process;
        requests wait until ``resume_memory_occupation``."""
        self.backend.scheduler.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's: the released weights back as they were and a fresh KV pool; waiting requests go on."""
        self.backend.scheduler.resume_memory_occupation(tags)

    def start_profile(self, **kwargs) -> None:
        """SGLang's: a ``jax.profiler`` trace of the forward steps (``serve.profiler``: ``output_dir``,
        ``start_step``, ``num_steps``, ``activities``, ``with_stack``, ...); a RequestError for a bad argument."""
        self.backend.scheduler.profiler.start(**kwargs)

    def stop_profile(self) -> None:
        self.backend.scheduler.profiler.stop()

    def close_session(self, session_id: str) -> None:
        """SGLang's: forget the session (its running requests run on); a RequestError if none of that id is open."""
        self.backend.sessions.close(session_id)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        """SGLang's: the target's weights from ``model_path`` (same architecture and shapes) without a restart, once
        the running requests finish; (success, message, paused requests). The draft head and tokenizer are kept."""
        return self.backend.update_weights_from_disk(model_path, load_format)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        """SGLang's: (name, tensor) pairs in the checkpoint's names (any subset; numpy, jax or torch tensors, bf16
        included) replace what they name in the served target, once the running requests finish (at once while
        generation is paused); (success, message). The draft head and tokenizer are kept."""
        return self.backend.update_weights_from_tensor(named_tensors, load_format, flush_cache)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the served target's tensor ``name`` (a checkpoint name) as float32 nested lists, its first
        ``truncate_size`` entries along the first axis."""
        return self.backend.get_weights_by_name(name, truncate_size)

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's: no request is admitted, prefilled or stepped until ``continue_generation``; ``abort`` aborts
        every running and waiting request first; ``retract`` frees the running ones' slots and K/V, to prefill them
        again over prompt and output when generation continues (with the weights then served); ``in_place`` keeps
        them where they stopped (a weight update then swaps at once, and they go on with the new weights)."""
        self.backend.pause_generation(mode)

    def continue_generation(self) -> None:
        self.backend.continue_generation()

    def get_server_info(self) -> dict:
        """What /get_server_info answers: the effective arguments, the version and the scheduler's state."""
        return self.backend.server_info()

    def shutdown(self) -> None:
        self.backend.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
