"""TPU preflight of the server's programs (`python -m specjax.preflight serve`): every prefill bucket, the decode step
and the EAGLE3 / EAGLE steps compiled by the real TPU compiler for abstract TPU chips (libtpu, from the `tpu` extra),
with their per-chip memory. Small Llama-shaped configs keep it fast; the full 8B programs are marked slow. Skipped
with a reason when libtpu is not installed."""

import os

import jax
import pytest
from preflight_helpers import GIB, PLAIN_SMALL_FLAGS, SMALL_FLAGS, preflight, rows, small_config

from specjax.models import target
from specjax.serve.launch import plan_pool

pytestmark = pytest.mark.usefixtures("default_precision")
SMOLLM2 = os.path.expanduser("~/.cache/specjax/SmolLM2-135M-Instruct")
HEAD = os.path.join(os.path.dirname(preflight.__file__), "heads", "smollm2-135m-instruct-eagle3")


def test_serve_preflight_compiles_every_program_with_tp(v5e, tmp_path, capsys):
    """plain prefill + decode, EAGLE3 prefill + step, EAGLE prefill + step, and each set's prompt-scoring chunk,
    over tp=2 of a v5e-4: each compiles with
    the Pallas kernel (run per shard under shard_map: XLA cannot partition a Mosaic call), fits, all-reduces the
    row-parallel matmuls, and holds the KV pool the server would allocate."""
    rc = preflight.main(["serve", "--model-path", small_config(tmp_path), "--tp-size", "2", "--topology", "v5e-4",
                         "--programs", "plain,EAGLE3,EAGLE", *SMALL_FLAGS])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = rows(out)
    names = ["plain prefill T=16", "plain decode step B=4", "EAGLE3 prefill T=16", "EAGLE3 step B=4 S=2 k=2 M=4",
             "EAGLE prefill T=16", "EAGLE step B=4 S=2 k=2 M=4", "plain prompt scoring T=16",
             "EAGLE3 prompt scoring T=16", "EAGLE prompt scoring T=16"]
    assert sorted(got) == sorted(names), out
    assert all(fits for *_, fits in got.values())
    assert out.count("attention: Pallas kernel") == 9 and "all-reduce" in out
    # the pool: 256 pages x 16 tokens of 2 target layers (+1 draft layer), K/V split over tp=2, fp32
    assert "KV pool 256 pages x 16 tokens = 4096 tokens (2 layers" in out
    assert "KV pool 256 pages x 16 tokens = 4096 tokens (3 layers" in out
    assert "draft vocab 512)" in out  # the trainer's 32000, capped at this target's 512 ids as the trainer caps it
    pool = 2 * 3 * 257 * 16 * 1 * 64 * 4  # K and V, 3 layers, 257 pages (scratch incl.), 1 kv head per chip
    assert got["EAGLE3 step B=4 S=2 k=2 M=4"][0] * GIB >= pool - 0.01 * GIB


def test_serve_preflight_reports_the_xla_fallback(v5e, tmp_path, capsys):
    """A head dim of 32 (two heads per 64 lanes): the kernel cannot serve it on TPU, the program compiles on the XLA
    path, and the table says so with the reason."""
    rc = preflight.main(["serve", "--model-path", small_config(tmp_path, heads=6, kv_heads=3, dtype="bfloat16",
                                                               head_dim=32),
                         "--topology", "v5e-1", "--programs", "plain", *PLAIN_SMALL_FLAGS])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("attention: XLA fallback (") == 3 and "head_dim 32" in out


def test_serve_preflight_fails_clearly_when_a_program_does_not_fit(v5e, tmp_path, capsys):
    """The whole HBM for the KV pool (--mem-fraction-static 1.0) leaves no room for the step's temporaries: exit 1,
    naming the program and what to change."""
    rc = preflight.main(["serve", "--model-path", small_config(tmp_path), "--topology", "v5e-1", "--programs",
                         "plain", "--mem-fraction-static", "1.0", "--max-running-requests", "4",
                         "--chunked-prefill-size", "16"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "preflight: error: plain prefill T=16" in err and "--mem-fraction-static" in err


@pytest.mark.parametrize("argv, message", [
    (["--tp-size", "8", "--topology", "v5e-4"], "needs 8 chips"),
    (["--topology", "v5e-4", "--programs", "plain,MEDUSA"], "unknown ['MEDUSA']"),
    (["--topology", "v9-4"], "unknown topology"),
    (["--topology", "v5e-4", "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1",
      "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"], "--speculative-num-steps"),
])
def test_serve_preflight_bad_input(v5e, tmp_path, capsys, argv, message):
    assert preflight.main(["serve", "--model-path", small_config(tmp_path), *argv]) == 1
    assert message in capsys.readouterr().err


def test_serve_preflight_reads_the_head_before_compiling(v5e, tmp_path, capsys, monkeypatch):
    """A --speculative-draft-model-path without a head is said before any program compiles (the plain programs
    compiled for minutes first)."""
    monkeypatch.setattr(preflight, "plain_programs", lambda *a, **k: pytest.fail("compiled before reading the head"))
    assert preflight.main(["serve", "--model-path", small_config(tmp_path), "--topology", "v5e-1",
                           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                           str(tmp_path / "nonexistent"), *SMALL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"preflight: error: --speculative-draft-model-path {tmp_path / 'nonexistent'}: ")


def test_abstract_setup_matches_what_the_server_builds(v5e, tmp_path):
    """The abstract params are the server's decode layout (``target.unstack_layers`` of the tp-sharded params) and
    the pool plan is the server's own (``serve.launch.plan_pool`` against the chip's HBM)."""
    ns = preflight._serve_parser().parse_args(["--model-path", small_config(tmp_path), "--tp-size", "2",
                                               "--topology", "v5e-4"])
    args, programs = preflight._serve_args(ns)
    assert programs == ["plain"]
    setup = preflight.serve_setup(args, v5e)
    want = jax.eval_shape(target.unstack_layers, target.param_shapes(setup.tcfg))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), setup.params) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert tuple(setup.params.layers[0].wq.sharding.spec) == (None, "tp", None)  # heads split over tp
    plan = plan_pool(args, setup.tcfg, None, setup.param_bytes, v5e.hbm_bytes)
    page = 2 * 2 * 16 * 1 * 64 * 4  # K and V, 2 layers, 16 tokens, 1 of 2 kv heads per chip, fp32
    assert plan.page_bytes == page
    assert plan.num_pages - 1 == int(0.85 * v5e.hbm_bytes - setup.param_bytes) // page
    # bf16 at head dim 64: without --page-size, pages of 32 slots (two per 128-lane row on a TPU); a given size stays
    for flags, z in (([], 32), (["--page-size", "16"], 16)):
        ns = preflight._serve_parser().parse_args(["--model-path", small_config(tmp_path, dtype="bfloat16"),
                                                   "--topology", "v5e-4", *flags])
        args, _ = preflight._serve_args(ns)
        preflight.serve_setup(args, v5e)
        assert args.page_size == z


@pytest.mark.slow
def test_serve_preflight_smollm2_with_its_head(v5e, capsys):
    """SmolLM2-135M with the packaged EAGLE3 head on one v5e chip at the default pool (0.85 of HBM: lane-packed, not
    copied), every prefill bucket up to 256 (minutes of CPU). 512-token chunks run the XLA path, which converts an
    fp32 pool to bf16 whole and does not fit (docs/07-preflight.md)."""
    if not os.path.isdir(SMOLLM2):
        pytest.skip(f"{SMOLLM2} not fetched (python -m specjax.convert fetch-smollm2)")
    rc = preflight.main(["serve", "--model-path", SMOLLM2, "--speculative-algorithm", "EAGLE3",
                         "--speculative-draft-model-path", HEAD, "--topology", "v5e-1", "--chunked-prefill-size",
                         "256"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "EAGLE3 step" in out and "plain decode step" in out


@pytest.mark.slow
@pytest.mark.parametrize("model, topology", [("llama-3.1-8b", "v5e-4"), ("llama-3.1-8b", "v4-8"),
                                             ("qwen2.5-7b", "v5e-4")])
def test_serve_preflight_8b_at_the_server_defaults(capsys, model, topology):
    """The full 7B/8B serve programs at the server's default flags, tp=4 (docs/07-preflight.md's tables; minutes of
    CPU each): every program runs the Pallas kernel (the 512-token prefill chunks in query tiles) and fits."""
    try:
        preflight.get_topology(topology)
    except preflight.PreflightError as e:
        pytest.skip(str(e))
    rc = preflight.main(["serve", "--model-path", model, "--tp-size", "4", "--speculative-algorithm", "EAGLE3",
                         "--programs", "plain,EAGLE3", "--largest-bucket-only", "--topology", topology])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = rows(out)
    assert len(got) == 4 and all(fits for *_, fits in got.values()), out
    assert out.count("attention: Pallas kernel") == 4, out


def test_long_prefill_chunks_stay_on_the_kernel_in_query_tiles():
    """A 512-token prefill chunk of Llama-8B's heads on one of 4 chips (8 q / 2 kv heads x 128, bf16) would put 1 MiB
    of queries in VMEM, and SmolLM2's bf16 chunk 9 MiB of [512, 512] fp32 scores, which Mosaic refuses (slow test
    below); the kernel takes both in query tiles of 256. Only new keys and values beyond VMEM (which every tile
    reads) send a span to the XLA path."""
    from specjax.kernels.tree_attention import tpu_unsupported_reason
    from specjax.kernels.tree_attention.kernel import query_tile
    for heads, kv_heads, head_dim, z, dtype in [(8, 2, 128, 16, "bfloat16"), (9, 3, 64, 16, "float32"),
                                                (9, 3, 64, 32, "bfloat16")]:
        for t in (8, 256, 512):
            assert tpu_unsupported_reason(heads, kv_heads, head_dim, z, dtype, tree_tokens=t) is None
        assert query_tile(heads, head_dim, dtype, 512) == 256
    assert "new keys and values" in tpu_unsupported_reason(40, 10, 128, 16, "float32", tree_tokens=512)


@pytest.mark.slow
@pytest.mark.parametrize("heads, kv_heads, head_dim, t, dtype, tile, compiles", [
    (8, 2, 128, 512, "bfloat16", 512, False), (8, 2, 128, 512, "bfloat16", None, True),
    (9, 3, 64, 512, "bfloat16", 512, False), (9, 3, 64, 384, "bfloat16", 384, True),
    (9, 3, 64, 512, "bfloat16", None, True), (36, 9, 128, 512, "float32", None, True),
    (40, 10, 128, 512, "float32", None, False)],
    ids=["llama-8b-tp4-512-one-tile", "llama-8b-tp4-512", "smollm2-512-one-tile", "smollm2-384-one-tile",
         "smollm2-512", "9-kv-heads-fp32-512", "10-kv-heads-fp32-512"])
def test_kernel_vmem_limits_are_mosaics(heads, kv_heads, head_dim, t, dtype, tile, compiles):
    """The limits are measured on v4 (16 MiB of VMEM, the least): in one query tile, Llama-8B's per-chip heads and
    SmolLM2's in bf16 (lane-packed 32-slot pages) exceed the scoped VMEM at T=512 (SmolLM2's compile at T=384); in the
    default tiles they compile; the new keys and values of 9 fp32 kv heads x 128 at T=512 (9 MiB counted) compile,
    of 10 do not. ``tpu_unsupported_reason`` agrees on the default tiling (about 1-5 s of CPU each)."""
    import functools

    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from specjax import kv_cache
    from specjax.kernels.tree_attention import tpu_unsupported_reason, tree_attention
    from specjax.platforms import lowering_for
    from preflight_helpers import topology
    dt = jnp.dtype(dtype)
    z = kv_cache.default_page_size(head_dim, dt, "tpu")
    if tile is None:
        assert (tpu_unsupported_reason(heads, kv_heads, head_dim, z, dt, tree_tokens=t) is None) == compiles
    sh = NamedSharding(Mesh([topology("v4-2").devices[0]], ("x",)), P())
    s = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=sh)
    pages = (1000, *kv_cache.pool_shape(1, 1, kv_heads, z, head_dim, dt)[2:])  # [P, K, Z / f, f * H]
    args = (s((1, t, heads, head_dim)), s((1, t, kv_heads, head_dim)), s((1, t, kv_heads, head_dim)),
            s((1, t, t), jnp.bool_), s(pages), s(pages), s((1, 8192), jnp.int32), s((1,), jnp.int32))
    fn = jax.jit(functools.partial(tree_attention, sm_scale=head_dim ** -0.5, query_tile_rows=tile))
    with lowering_for("tpu"):
        if compiles:
            fn.lower(*args).compile()
        else:
            with pytest.raises(Exception, match="(?i)vmem"):
                fn.lower(*args).compile()


def test_hub_ids_name_their_shipped_shape():
    from specjax import configs
    assert configs.model_shape("meta-llama/Llama-3.1-8B-Instruct").endswith("llama-3.1-8b.json")
    assert configs.model_shape("Qwen/Qwen2.5-7B-Instruct").endswith("qwen2.5-7b.json")
    assert configs.model_shape("someone/unknown-model") is None
