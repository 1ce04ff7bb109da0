"""How a batch of requests becomes fixed shapes: request validation and the power-of-two buckets that let a few
compiled programs serve every prompt length, batch size and context length."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from specjax import sampling
from specjax.kernels.cpu_dense import MAX_TOKENS as KERNEL_MAX_TOKENS

# The shortest prefill chunk past the attention and RoPE kernels' tokens (``cpu_dense.MAX_TOKENS``): offline
# generation pads every prompt to at least this; a server on a CPU also has the few-row buckets below. (The
# products of an fp32 chunk of up to ``cpu_dense.MAX_PROMPT_ROWS`` rows in all take the kernels too; larger ones
# keep XLA's GEMMs.)
MIN_PREFILL_BUCKET = KERNEL_MAX_TOKENS + 1
MIN_FEW_ROW_PREFILL = 8  # the shortest prefill chunk of a server whose products take the CPU kernels
MIN_PAGE_BUCKET_TOKENS = 256  # the shortest page-table view a decode step compiles for
PREFILL_CHUNK = 512  # the widest prefill call: a longer prompt runs as several chunks


@dataclasses.dataclass(frozen=True)
class PrefillPrice:
    """What splitting a prefill costs, in padded prompt tokens (``serving_prefill_chunks``)."""
    call: int  # one more call (each reads every weight once, whatever its width)
    over_cache: int  # more for a chunk past the few-row kernels' width that attends to a prompt's cached part


# Measured on a CPU (SmolLM2-135M fp32, 2-core Xeon, one call of t tokens at the runner: 8 / 15 / 16 / 32 / 64 / 128
# / 256 tokens took 25 / 35 / 39 / 59 / 93 / 160 / 320 ms, ~1.25 ms a token at 128-256): a call is worth ~14 tokens.
# A 32- or 64-token chunk after a cached part cost 17-29 ms more than alone there while XLA's block loop attended to
# the cache (18 tokens' worth); the kernels' blocked prompt path cut that extra to 10-27 ms at 32 tokens on the
# 2-core Zen 1 VM (from 36-46 there), about 45% of it: 8 tokens (a 16-token chunk after a cached part 71-81 ms there
# against 90 for two 8-token ones; docs/benchmarks.md, sixty-fifth session). An accelerator's call price is
# its machine balance (peak FLOP/s per byte/s of HBM x bytes per weight / 2: ~230 on a TPU v4, ~300 on an H100 in
# bf16), so there a prompt up to the widest chunk keeps one padded call.
PREFILL_PRICE = {"cpu": PrefillPrice(call=14, over_cache=8)}
PREFILL_PRICE_ACCELERATOR = PrefillPrice(call=256, over_cache=0)


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` up to ``hi``, with ``hi`` itself as the last bucket."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


def pick(buckets: list[int], need: int) -> int:
    """The smallest bucket >= ``need``."""
    for b in buckets:
        if b >= need:
            return b
    raise ValueError(f"{need} exceeds the largest bucket {buckets[-1]}")


def page_buckets(page_size: int, pages_per_seq: int, xla_path: bool = False) -> list[int]:
    """Page-table widths a serving step is compiled for. Attention reads only the pages a row holds, so a wider view
    costs little. On the XLA path (``xla_path``: ``layers.paged_attention``, whose loop runs over the blocks the
    longest row holds) one width, the whole table: a server then compiles every program at warmup and none while
    serving (a SmolLM2 batch-1 decode step measured the same at 32 and 256 columns). The Pallas kernel copies each
    row of the view into SMEM, so it gets powers of two from ``MIN_PAGE_BUCKET_TOKENS`` worth of pages."""
    if xla_path:
        return [pages_per_seq]
    return pow2_buckets(max(1, -(-MIN_PAGE_BUCKET_TOKENS // page_size)), pages_per_seq)


def pow2_bucket(n: int, lo: int, hi: int) -> int:
    """The bucket of ``pow2_buckets(lo, hi)`` that holds ``n``, or ``hi`` when ``n`` is larger (the caller chunks)."""
    return pick(pow2_buckets(lo, hi), min(n, hi))


def serving_prefill_buckets(limit: int, few_rows: bool) -> list[int]:
    """The widths a server pads one request's prefill chunk to, the widest ``limit``: powers of two from
    MIN_PREFILL_BUCKET (XLA's attention). With ``few_rows`` (the CPU kernels take the products: ``cpu_dense``) also
    powers of two from MIN_FEW_ROW_PREFILL and KERNEL_MAX_TOKENS itself, so that a short uncached tail (a reused
    prefix, a short prompt, the end of a chunked one) runs wholly in the kernels instead of padding to 16 tokens:
    a 1-15-token tail of SmolLM2 fp32 took 32-38 ms against 63-65 ms (docs/benchmarks.md).
    Both runners take these buckets, so a prompt gets the same chunks (and K/V bits) in either."""
    limit = max(int(limit), 1)
    out = set(pow2_buckets(MIN_PREFILL_BUCKET, limit))
    if few_rows:
        out |= {b for b in pow2_buckets(MIN_FEW_ROW_PREFILL, KERNEL_MAX_TOKENS) if b < limit}
    return sorted(out)


def serving_prefill_chunks(n: int, buckets: Sequence[int], price: PrefillPrice,
                           cached: bool = False) -> list[tuple[int, int]]:
    """How a server prefills the n uncached tokens of a prompt (``cached``: some before them are in the cache):
    chunks [(tokens, bucket width)], full ones first, each padded to its bucket, chosen to minimise the padded tokens
    plus ``price`` (``PREFILL_PRICE``). On a CPU a 70-token prompt runs as 64 + 6 (in the 8-token bucket) and a
    129-token one as 128 + 1, instead of one 128- / 256-token call (an 85-token one as 64 + 15 + 6, level with one
    128-token call in the measurements). Deterministic in its arguments: both runners take it, so a prompt gets the
    same chunks (and K/V bits) in either."""
    first, later = _first_chunks(tuple(buckets), price)
    table, out = later if cached else first, []
    while n > 0:
        b = buckets[-1] if n >= len(table) else table[n]
        out.append((min(b, n), b))
        n -= min(b, n)
        table = later
    return out


@functools.lru_cache(maxsize=16)
def _first_chunks(buckets: tuple[int, ...], price: PrefillPrice) -> tuple[list[int], list[int]]:
    """(first, later): the bucket of the first chunk of the cheapest plan for m tokens (m < 2 x the widest bucket;
    past that, widest chunks first), for a prompt with nothing cached and for one whose chunks all come after a
    cached part. Ties go to the wider bucket (fewer calls)."""
    top = 2 * buckets[-1]
    over = [price.over_cache if b > KERNEL_MAX_TOKENS else 0 for b in buckets]
    later_cost, later = [0] * top, [0] * top
    for m in range(1, top):  # after a cached part: every chunk pays ``over_cache``, the rest is again "later"
        c, b = min((b + price.call + o + later_cost[max(m - b, 0)], -b) for b, o in zip(buckets, over))
        later_cost[m], later[m] = c, -b
    first = [0] + [-min((b + price.call + later_cost[max(m - b, 0)], -b) for b in buckets)[1] for m in range(1, top)]
    return first, later


def prefill_chunks(longest: int) -> tuple[int, int]:
    """(width, count) of the chunks that prefill a batch whose longest prompt has ``longest`` tokens: one
    power-of-two chunk (>= MIN_PREFILL_BUCKET) up to PREFILL_CHUNK tokens, else chunks of PREFILL_CHUNK. Plain and
    speculative generation both prefill this way: a prompt prefilled in other chunks gets other rounding in its K/V
    (in bf16 enough to change the first token of some prompts over 512 tokens), and speculative greedy must give
    plain greedy's tokens. One width per call: an offline call compiles its chunk widths as it meets them, so it
    pads rather than split; a server, whose buckets are all compiled at warmup, splits (``serving_prefill_chunks``)."""
    chunk = pow2_bucket(longest, MIN_PREFILL_BUCKET, PREFILL_CHUNK)
    return chunk, -(-longest // chunk)


def prefill_plan(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray, np.ndarray]]]:
    """The prompts right-padded to whole ``prefill_chunks`` plus one column (i32[B, n * chunk + 1], zeros past each
    prompt, so that column c + 1 holds the token after column c), and per chunk (lo, hi, valid bool[B, hi - lo],
    last bool[B]: the rows whose prompt ends in it)."""
    lengths = np.asarray([len(p) for p in prompts])
    chunk, n_chunks = prefill_chunks(int(lengths.max()))
    tokens = np.zeros((len(prompts), n_chunks * chunk + 1), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    plan = []
    for lo in range(0, n_chunks * chunk, chunk):
        hi = lo + chunk
        plan.append((lo, hi, np.arange(lo, hi)[None, :] < lengths[:, None], (lengths > lo) & (lengths <= hi)))
    return tokens, plan


def capacity_for(budget: np.ndarray, capacity: int | None) -> int:
    """The new-token room a call's buffers are sized for: ``capacity`` when given (it must hold every row's budget),
    else the largest budget. A short call given a longer call's capacity runs the longer call's compiled programs."""
    need = int(np.max(budget))
    if capacity is None:
        return need
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < need:
        raise ValueError(f"capacity must be an int >= the largest max_new_tokens ({need}), got {capacity!r}")
    return int(capacity)


def warmup_budget(max_new_tokens: int) -> dict:
    """The budget keywords of a warm-up call (``generate``, ``speculative_generate``): 2 tokens over buffers sized for
    ``max_new_tokens``, which compiles (or loads) every program of the same call with ``max_new_tokens``."""
    return dict(max_new_tokens=min(2, max_new_tokens), capacity=max_new_tokens)


def validate_requests(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens, temperature, top_k, top_p,
                      min_p) -> np.ndarray:
    """Raise ValueError for an empty prompt, a token id outside the vocabulary, a negative budget or bad sampling
    parameters. ``max_new_tokens`` and the sampling parameters are scalars or one value per prompt. Returns the
    token budget of each prompt, i64[B]."""
    b = len(prompts)
    limit = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (b,)).astype(np.int64)
    if (limit < 0).any():
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    for t, k, p, m in zip(*(np.broadcast_to(np.asarray(v), (b,)) for v in (temperature, top_k, top_p, min_p))):
        sampling.validate(float(t), int(k), float(p), float(m))
    return limit
