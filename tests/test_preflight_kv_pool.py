"""TPU preflight: the server's programs at a long context hold no copy of the KV pool (libtpu, from the `tpu` extra;
skipped with a reason without it). In its own file so that the two pytest workers share the preflight tests, which
run last (tests/conftest.py)."""

import re

import pytest
from preflight_helpers import preflight, rows, small_config

pytestmark = pytest.mark.usefixtures("default_precision")

# What the claim is about is the pool, the page table and the context; a 16-token prefill chunk and a (2,2,4) tree
# compile 3x faster than the server's defaults (256, (5,4,8)) and read the same pool the same way.
SMALL_TREE = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype, tp, context", [
    (8, 4, 128, "bfloat16", 2, 131072), (14, 2, 128, "bfloat16", 2, 131072), (9, 3, 64, "float32", 1, 8192)],
    ids=["llama-8b-like", "qwen2.5-7b-like", "smollm2-135m-like"])
def test_kv_pool_is_read_and_written_in_place_at_long_context(v5e, tmp_path, capsys, heads, kv_heads, head_dim,
                                                              dtype, tp, context):
    """Llama-8B's per-chip attention shape (2 kv heads x 128, bf16, tp=2) and Qwen2.5-7B's at tp 4 (7 heads, ONE kv
    head per chip) at a 128k context with 32 slots, and SmolLM2-135M's on one chip (3 kv heads x 64, fp32): the
    kernel serves all three, the programs hold no copy of the KV pool (head-major pages tile without padding, head
    dim 64 lane-packed two slots per 128-lane row; the kernel reads the stacked pool at its layer, the XLA path
    gathers from it, the K/V write scatters rows of head_dim in place) and the page table (32 x 8193 pages, over
    1 MiB) needs no SMEM of that size (the kernel fetches one sequence's row at a time)."""
    path = small_config(tmp_path, heads=heads, kv_heads=kv_heads, dtype=dtype, head_dim=head_dim, context=context)
    rc = preflight.main(["serve", "--model-path", path, "--tp-size", str(tp), "--topology", "v5e-4", "--programs",
                         "plain,EAGLE3", "--largest-bucket-only", "--max-running-requests", "32",
                         "--chunked-prefill-size", "16", "--mem-fraction-static", "0.5", *SMALL_TREE])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = rows(out)
    pool = float(re.search(r"KV pool .*?\(2 layers, ([\d.]+) GiB per chip\)", out)[1])
    assert pool > 5 and f"context {context}" in out, out
    assert out.count("attention: Pallas kernel") == 6, out  # prefill, step and prompt scoring of both sets
    for name, (_, temp, _, fits) in got.items():
        assert fits and temp < 0.05 * pool, (name, temp, pool, out)
