"""The slot-level decoding interface between the server's scheduler (serve/scheduler.py) and the model.

A runner owns a fixed number of slots (the running batch, ``max_batch``). Requests join a free slot (``prefill``)
and leave it between steps; ``step`` advances every active slot by one plain decode step or one speculative
draft-verify-commit step, entirely on device. ``step`` is ``launch`` (dispatch the step, return at once) then
``collect`` (read its tokens): the scheduler's overlap schedule launches step N+1 before it collects step N, so the
host's work on a step's tokens runs while the device computes the next one. The target and draft KV caches share
one page table: page ids handed out by the scheduler index both pools.

Implementations:
- ``serve.runners.plain.PlainRunner``: plain decoding (one token per step).
- ``specjax.serve.runners.spec.SpecRunner``: EAGLE3 / EAGLE speculative decoding (1..num_steps+1 tokens per step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax import prompt_logprobs as prompt_logprobs_lib, sampling
from specjax.batching import (PREFILL_PRICE, PREFILL_PRICE_ACCELERATOR, serving_prefill_buckets,
                              serving_prefill_chunks)
from specjax.kernels import cpu_dense
from specjax.models import target
from specjax.sampling import SamplingRow
from specjax.sharding import use_mesh


class Runner(Protocol):
    max_batch: int  # number of slots B
    page_size: int  # Z tokens per page
    pages_per_seq: int  # page-table row length; max tokens per sequence = pages_per_seq * page_size
    num_pages: int  # pages in the pool(s)
    tokens_per_step: int  # W = most tokens one step can emit per slot (1 plain, num_steps + 1 speculative)

    def init_state(self) -> Any:
        """Device state: caches (all pages free), per-slot lengths 0, slots inactive."""

    def prefill(self, state: Any, slot: int, tokens: np.ndarray, page_row: np.ndarray, row: SamplingRow,
                cached: int = 0) -> tuple[Any, int]:
        """Run the prompt ``tokens`` (i32[n]) into ``slot``, whose page-table row becomes ``page_row`` (i32[pps]).
        The first ``cached`` tokens are already in the cache pages (prefix reuse) and are not recomputed.
        ``row``: the request's ``sampling.SamplingRow`` (a mapping of its fields is coerced), or the one-row
        ``sampling.SamplingBatch`` that ``slot_row`` saved (a retracted request going on). Returns (state, first
        generated token)."""

    def step(self, state: Any, active: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        """One decode step for all slots with ``active`` (bool[B]) set.
        Returns (state, tokens i32[B, W], counts i32[B]): slot b emitted tokens[b, :counts[b]] (0 if inactive)."""

    def launch(self, state: Any, active: np.ndarray) -> tuple[Any, "Launched"]:
        """Dispatch ``step`` without waiting for it: returns (state, a handle for ``collect``). A slot may be
        released (and given to a new request) before its launched step is collected; the step's writes stay within
        ``2 * tokens_per_step`` positions past what the host has collected for that slot."""

    def collect(self, launched: "Launched", keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens i32[B, W], counts i32[B]) of a launched step, for the slots in ``keep`` (default: all it ran;
        a slot released since its launch is left out: its counts are 0 and its host mirror is untouched)."""

    def release(self, state: Any, slot: int) -> Any:
        """Mark the slot free (its pages are returned by the scheduler)."""

    def set_page_rows(self, state: Any, rows: dict[int, np.ndarray]) -> Any:
        """Give running slots longer page-table rows (``rows``: slot -> i32[pps]): the scheduler hands a request
        pages as it grows, before a step writes past the ones it has."""

    def set_target_params(self, params) -> None:
        """Serve new target weights of the same shapes (a weight update, with no request running)."""


@dataclasses.dataclass
class Launched:
    """A step on its way through the device: ``tokens`` / ``counts`` are its (unread) device outputs."""
    active: np.ndarray  # bool[B]: the slots it runs
    nb: int = 0  # the batch bucket: tokens / counts cover slots [0, nb)
    tokens: Any = None  # i32[nb, W'] on device (None when nothing ran)
    counts: Any = None  # i32[nb] on device (None: one token per active slot)
    shape: tuple[int, int, int] | None = None  # the tree shape it ran (speculative runners)
    drafts: int = 0  # draft tokens it proposed per row (num_draft_tokens - 1; 0 for plain and target-only steps)

    def kept(self, keep: np.ndarray | None = None) -> np.ndarray:
        """bool[B]: the slots of ``keep`` (default: every slot) that this step ran."""
        return self.active.copy() if keep is None else np.asarray(keep, bool) & self.active

    def read(self, width: int, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Host (tokens i32[B, width], counts i32[B]) of the ``kept`` slots (zeros elsewhere); waits for the step."""
        b = len(self.active)
        tokens, counts = np.zeros((b, width), np.int32), np.zeros((b,), np.int32)
        if self.tokens is None:
            return tokens, counts
        toks = np.asarray(self.tokens).reshape(self.nb, -1)
        tokens[:self.nb, :toks.shape[1]] = toks
        counts[:self.nb] = self.active[:self.nb] if self.counts is None else np.asarray(self.counts)
        dropped = ~self.kept(keep)
        tokens[dropped], counts[dropped] = 0, 0
        return tokens, counts


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_rows(page_table, slots, rows):
    return page_table.at[slots].set(rows)


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def prefill_buckets(limit: int, mesh=None) -> list[int]:
    """``batching.serving_prefill_buckets`` for a runner on ``mesh`` (None: the default backend): the few-row buckets
    where its products take the CPU kernels (a CPU, the kernels built)."""
    return serving_prefill_buckets(limit, few_rows=_platform(mesh) == "cpu" and cpu_dense.available())


class RunnerCommon:
    """What both runners share; a runner sets ``target_params``, ``target_cfg``, ``mesh``, ``pages_per_seq``,
    ``prefill_buckets``, ``page_buckets``, ``cache_attention`` (its target's pool attention) and ``_lengths`` (the
    host mirror of the slots' committed lengths)."""

    def step(self, state, active: np.ndarray, **launch_kw):
        """``launch`` then ``collect``: one step, its tokens read (the ``Runner`` protocol)."""
        state, launched = self.launch(state, active, **launch_kw)
        tokens, counts = self.collect(launched)
        return state, tokens, counts

    def step_at_zero(self, state, active: np.ndarray, **step_kw):
        """A step of the ``active`` slots at length 0 over the scratch page (warmup): compiles the step's shape
        without touching any live slot, and leaves those slots empty. ``step_kw`` go to ``step``."""
        self._lengths[active] = 0
        state, _, _ = self.step(state, active, **step_kw)
        self._lengths[active] = 0
        lengths = jnp.where(jax.device_put(active), 0, state.cache.lengths)
        return dataclasses.replace(state, cache=dataclasses.replace(state.cache, lengths=lengths))

    def set_page_rows(self, state, rows: dict[int, np.ndarray]):
        """The ``Runner`` protocol's: the rows written in one compiled program for any number of slots (the
        update padded to ``max_batch`` rows with repeats of the first)."""
        slots = np.full((self.max_batch,), next(iter(rows)), np.int32)
        table = np.empty((self.max_batch, self.pages_per_seq), np.int32)
        table[:] = rows[int(slots[0])]
        for i, (slot, row) in enumerate(rows.items()):
            slots[i], table[i] = slot, row
        with use_mesh(self.mesh):
            page_table = _set_rows(state.cache.page_table, slots, table)
        return dataclasses.replace(state, cache=dataclasses.replace(state.cache, page_table=page_table))

    def row_batch(self, row, tokens, width: int = 1) -> sampling.SamplingBatch:
        """A prefill's one-row SamplingBatch: a saved slot row (``slot_row``: a retracted request's random stream
        and penalty state go on) as it is, else a fresh row for the request's SamplingRow (or mapping) and prompt
        ``tokens``."""
        if isinstance(row, sampling.SamplingBatch):
            return row
        row = SamplingRow.coerce(row)
        return sampling.SamplingBatch.from_rows([row], self.target_cfg.vocab_size, [tokens], width=width,
                                                seeds=[self._seeds.next(row)])

    def slot_row(self, state, slot: int) -> sampling.SamplingBatch:
        """The slot's sampling row (parameters, random stream, penalty counts) as a one-row batch on the device,
        for ``prefill`` to take when the request is prefilled again (a retraction)."""
        idx = jax.device_put(np.asarray([slot], np.int32))
        # read back and placed as ``row_batch``'s fresh rows are (a mesh's sharding would compile the prefill again)
        return jax.tree.map(lambda a: jax.device_put(np.asarray(jnp.take(a, idx, axis=0))), state.sampling)

    WEIGHT_FIELDS = ("params", "target_params", "draft", "prefill_draft")  # the runners' attributes of weights

    def release_weights(self) -> None:
        """SGLang's release_memory_occupation of the weights: each device array of the runner's weights (shared
        ones once) copied to host memory, then freed on the device (``resume_weights`` puts them back)."""
        arrays = {id(x): x for f in self.WEIGHT_FIELDS for x in jax.tree.leaves(vars(self).get(f))
                  if isinstance(x, jax.Array)}
        # (host copy, sharding or None for an uncommitted array (loaded so that programs do not pin a device), the
        # freed array: kept referenced, so that no other object takes its id meanwhile)
        self._host_weights = {i: (np.array(x, copy=True), x.sharding if x.committed else None, x)
                              for i, x in arrays.items()}
        for x in arrays.values():
            x.delete()

    def resume_weights(self) -> None:
        """The weights ``release_weights`` freed, back on the device with their shardings, committed or not as they
        were (shared arrays shared again): the compiled programs take them as they took the old."""
        if getattr(self, "_host_weights", None) is None:
            return
        back = {i: jax.device_put(h, s) for i, (h, s, _) in self._host_weights.items()}
        for f in self.WEIGHT_FIELDS:
            if f in vars(self):  # (an attribute, not a property naming another)
                tree = jax.tree.map(lambda x: back.get(id(x), x) if isinstance(x, jax.Array) else x, vars(self)[f])
                if isinstance(tree, target.TargetParams) and tree.embed_bits is not None:  # a view of the table
                    tree = dataclasses.replace(tree, embed_bits=target.embed_bits(tree.embed))  # again, not a copy
                setattr(self, f, tree)
        self._host_weights = None

    def prefill_chunks(self, n: int, cached: bool = False) -> list[tuple[int, int]]:
        """``batching.serving_prefill_chunks`` of an n-token prefill (after a cached part: ``cached``) on this
        runner's platform and buckets."""
        price = PREFILL_PRICE.get(_platform(self.mesh), PREFILL_PRICE_ACCELERATOR)
        return serving_prefill_chunks(n, self.prefill_buckets, price, cached)

    def warm_prefills(self, state):
        """Compile every prefill bucket (slot 0 over the scratch page 0, released after) and the page-table update;
        returns the state."""
        row = np.zeros((self.pages_per_seq,), np.int32)  # page 0 is the scheduler's scratch page
        greedy = SamplingRow(temperature=0.0)
        for t in self.prefill_buckets:
            state, _ = self.prefill(state, 0, np.zeros((t,), np.int32), row, greedy)
            state = self.release(state, 0)
        return self.set_page_rows(state, {0: row})  # compiled too: requests' pages grow while they run

    def logprobs(self, state, ids: bool = True):
        """``sampling.read_logprobs`` of the slots: the logprobs of the tokens of the latest prefill / step (and of
        the ids the rows name, with ``ids``)."""
        return sampling.read_logprobs(state.sampling, ids)

    def score_prompt(self, state, page_row, tokens, begin: int, count: int, temperature: float,
                     logprob_ids=()) -> list:
        """``prompt_logprobs.score_prompt``: the logprobs of prompt ``tokens`` after positions [begin, begin +
        count) (and of ``logprob_ids`` there), read against the K/V its prefill left in this runner's target pool
        (``page_row``)."""
        return prompt_logprobs_lib.score_prompt(
            self.target_params, self.target_cfg, state.cache, page_row, tokens, begin, count, temperature,
            buckets=self.prefill_buckets, page_size=self.page_size, page_buckets=self.page_buckets,
            cache_attention=self.cache_attention, mesh=self.mesh, logprob_ids=logprob_ids)
