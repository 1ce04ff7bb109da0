"""Request checks and shape buckets (specjax.batching), against the doubling loops the runners used to write out."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache
from specjax.batching import (PREFILL_PRICE, PREFILL_PRICE_ACCELERATOR, PrefillPrice, pick, pow2_bucket, pow2_buckets,
                              serving_prefill_buckets, serving_prefill_chunks, validate_requests)
from specjax.kernels import cpu_dense


def doubling(n: int, lo: int, hi: int) -> int:
    """Power-of-two chunk >= n from lo, bounded by hi (speculative/spec_generate.py's former _bucket /
    _pow2_at_least)."""
    t = lo
    while t < n and t < hi:
        t *= 2
    return min(t, hi)


@pytest.mark.parametrize("lo,hi", [(16, 512), (1, 8), (16, 48), (1, 1), (32, 16)])
def test_pow2_bucket_is_the_doubling_rule(lo, hi):
    for n in range(1, 2 * hi + 3):
        assert pow2_bucket(n, lo, hi) == doubling(n, lo, hi), (n, lo, hi)


def test_buckets_and_pick():
    assert pow2_buckets(16, 48) == [16, 32, 48]
    assert pow2_buckets(1, 8) == [1, 2, 4, 8]
    assert pick([16, 32, 48], 33) == 48
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        pick([16, 32, 48], 49)


def test_serving_prefill_buckets():
    """XLA's powers of two from 16, and with the few-row kernels 8 and their MAX_TOKENS below the widest chunk."""
    assert cpu_dense.MAX_TOKENS == 15
    assert serving_prefill_buckets(512, few_rows=False) == [16, 32, 64, 128, 256, 512]
    assert serving_prefill_buckets(512, few_rows=True) == [8, 15, 16, 32, 64, 128, 256, 512]
    assert serving_prefill_buckets(48, few_rows=True) == [8, 15, 16, 32, 48]
    assert serving_prefill_buckets(10, few_rows=True) == [8, 10]
    assert serving_prefill_buckets(10, few_rows=False) == [10]
    assert serving_prefill_buckets(3, few_rows=True) == [3]


@pytest.mark.parametrize("few_rows,call,over", [(True, 14, 18), (False, 256, 0), (True, 8, 12), (True, 20, 0)])
@pytest.mark.parametrize("cached", [False, True])
def test_serving_prefill_chunks_are_the_cheapest_set_of_calls(few_rows, call, over, cached):
    """Against every multiset of chunks (up to 5 of each few-row bucket and 3 of each other narrower one, enough at
    these prices: more cost more than one wider call): the plan covers n, only its last chunk is partial, and it
    costs the least padded tokens + ``call`` per call + ``over`` per XLA-width chunk after a cached part (the
    first chunk, the widest, is the one that has none before it when nothing is cached)."""
    buckets = serving_prefill_buckets(256, few_rows)
    price = PrefillPrice(call=call, over_cache=over)
    widest, narrow = buckets[-1], np.array(buckets[:-1])
    xla = narrow > cpu_dense.MAX_TOKENS
    counts = np.array(list(itertools.product(*[range(4 if x else 6) for x in xla])))  # [S, len(narrow)]

    def plan_cost(plan):
        wide = sum(b > cpu_dense.MAX_TOKENS for _, b in plan)
        first_free = not cached and plan[0][1] > cpu_dense.MAX_TOKENS
        return sum(b + call for _, b in plan) + over * (wide - first_free)

    for n in range(1, 2 * widest + 40):
        plan = serving_prefill_chunks(n, buckets, price, cached)
        assert sum(m for m, _ in plan) == n
        assert all(m == b for m, b in plan[:-1]) and 1 <= plan[-1][0] <= plan[-1][1]
        assert all(b in buckets for _, b in plan) and plan[0][1] == max(b for _, b in plan)
        w = -(-max(n - int(counts.max(0) @ narrow), 0) // widest)  # the fewest widest chunks any candidate needs
        best = None
        for k in range(w, w + 3):
            cap = counts @ narrow + k * widest
            wide = counts @ xla + k
            cost = counts @ (narrow + call) + k * (widest + call) + over * (wide - ((wide > 0) & (not cached)))
            if (cap >= n).any():
                best = min(best if best is not None else cost[cap >= n].min(), cost[cap >= n].min())
        assert plan_cost(plan) == best, (n, plan, best)


def test_serving_prefill_chunks_examples():
    """On a CPU a short tail gets its own narrow call; an accelerator pads a prompt up to the widest chunk."""
    cpu, acc = serving_prefill_buckets(512, True), serving_prefill_buckets(512, False)
    price = PREFILL_PRICE["cpu"]
    assert serving_prefill_chunks(70, cpu, price) == [(64, 64), (6, 8)]
    assert serving_prefill_chunks(129, cpu, price) == [(128, 128), (1, 8)]
    assert serving_prefill_chunks(120, cpu, price) == [(120, 128)]
    assert serving_prefill_chunks(16, cpu, price) == [(16, 16)]
    assert serving_prefill_chunks(16, cpu, price, cached=True) == [(16, 16)]  # 16 tokens after a cache: one call
    assert serving_prefill_chunks(20, cpu, price, cached=True) == [(15, 15), (5, 8)]
    assert serving_prefill_chunks(1100, cpu, price)[:2] == [(512, 512), (512, 512)]
    assert serving_prefill_chunks(70, acc, PREFILL_PRICE_ACCELERATOR) == [(70, 128)]
    assert all(len(serving_prefill_chunks(n, acc, PREFILL_PRICE_ACCELERATOR)) == 1 for n in range(1, 513))


def test_validate_requests():
    assert validate_requests([[1, 2], [3]], 10, [4, 0], 0.0, -1, 1.0, 0.0).tolist() == [4, 0]
    for prompts, budget, match in [([[1], []], 4, "prompt 1 is empty"), ([[1, 12]], 4, r"outside \[0, 10\): \[12\]"),
                                   ([[1]], -1, "max_new_tokens must be >= 0")]:
        with pytest.raises(ValueError, match=match):
            validate_requests(prompts, 10, budget, 0.0, -1, 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        validate_requests([[1]], 10, 4, -1.0, -1, 1.0, 0.0)
    for t, p, name in ((float("nan"), 1.0, "temperature"), (float("inf"), 1.0, "temperature"),
                       (1.0, float("nan"), "top_p")):  # NaN passed the range checks: a silent empty answer
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            validate_requests([[1]], 10, 4, t, -1, p, 0.0)



def test_a_cache_too_large_for_memory_is_a_clear_error():
    """A budget whose KV cache cannot be allocated (``generate --max-new-tokens 100000000`` asked for 4 TB) is a
    ValueError that says how large and what to do, not XLA's RESOURCE_EXHAUSTED traceback (here a petabyte)."""
    with pytest.raises(ValueError, match=r"GiB of keys and values\) does not fit in this device's memory"):
        kv_cache.init_cache(1024, 16, 16384, 1, 2 ** 20, page_size=2 ** 20, dtype=jnp.float32)
