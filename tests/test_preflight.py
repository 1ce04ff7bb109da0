"""TPU preflight: the tree-attention kernel and the train step compiled by the real TPU compiler for abstract TPU
devices (libtpu, from the `tpu` extra), on any host. Skipped with a reason when libtpu is not installed."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from preflight_helpers import preflight, topology

from specjax import configs, kv_cache
from specjax.kernels.tree_attention import make_cache_attention, tree_attention, tpu_unsupported_reason
from specjax.kernels.tree_attention import kernel as kernel_lib
import specjax.kernels.tree_attention as hook_pkg
from specjax.platforms import lowering_for


@functools.lru_cache(maxsize=None)
def one_chip(generation: str):
    return topology(f"{generation}-{2 if generation in ('v4', 'v5p') else 1}").devices[0]


def compile_kernel(chip, *, groups, kv_heads, head_dim, t, page_size, dtype, fn=tree_attention, b=2, pps=8,
                   num_pages=40):
    sh = NamedSharding(Mesh([chip], ("x",)), P())
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    n = groups * kv_heads
    pool = kv_cache.pool_shape(1, num_pages, kv_heads, page_size, head_dim, dtype)[1:]  # as the server allocates it
    args = (s((b, t, n, head_dim)), s((b, t, kv_heads, head_dim)), s((b, t, kv_heads, head_dim)),
            s((b, t, t), jnp.bool_), s(pool), s(pool), s((b, pps), jnp.int32), s((b,), jnp.int32))
    with lowering_for("tpu"):
        return jax.jit(functools.partial(fn, sm_scale=head_dim ** -0.5)).lower(*args).compile()


# (G, K, H, T, Z, dtype): each generation gets head dims 64 and 128, odd and even GQA groups, tree sizes 1 and 64+,
# page sizes 16 and 128, bf16 and fp32; SmolLM2-135M (9 heads / 3 kv heads, H 64) in fp32 everywhere and in bf16 on
# v4; one kv head per chip in bf16 (Qwen2.5-7B's 28/4 heads at tp 4) on v5e. Pools are shaped as the server
# allocates them (kv_cache.pool_shape): head dim 64 is lane-packed (two slots per 128-lane row) in fp32 and in bf16
# from 32-slot pages, unpacked in bf16 at 16-slot pages (v4's and v5e's bf16 cases at Z=16; v4's at Z=32 packed).
MATRIX = {
    "v4": [(3, 3, 64, 8, 16, "float32"), (4, 8, 128, 1, 128, "bfloat16"), (7, 2, 64, 80, 16, "bfloat16"),
           (3, 3, 64, 8, 16, "bfloat16"), (3, 3, 64, 8, 32, "bfloat16")],
    "v5e": [(3, 3, 64, 64, 128, "float32"), (1, 8, 128, 80, 16, "bfloat16"), (5, 4, 64, 1, 16, "bfloat16"),
            (7, 1, 128, 8, 16, "bfloat16")],
    "v5p": [(3, 3, 64, 1, 16, "float32"), (8, 1, 128, 64, 128, "float32"), (3, 2, 128, 8, 16, "bfloat16")],
    "v6e": [(3, 3, 64, 80, 16, "float32"), (4, 2, 64, 8, 128, "bfloat16"), (2, 6, 128, 64, 16, "float32")],
}


@pytest.mark.parametrize("generation", list(MATRIX))
def test_kernel_compiles_for_tpu_matrix(generation):
    chip = one_chip(generation)
    for g, k, h, t, z, dt in MATRIX[generation]:
        assert tpu_unsupported_reason(g * k, k, h, z, dt) is None
        compiled = compile_kernel(chip, groups=g, kv_heads=k, head_dim=h, t=t, page_size=z, dtype=jnp.dtype(dt))
        assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()  # the Mosaic kernel, compiled in


def test_preflight_catches_a_tpu_only_error_that_interpret_mode_passes():
    """A 512-token prefill chunk at SmolLM2's heads (9 x 64, fp32) in one query tile runs correctly in interpret mode,
    but its query block exceeds the TPU's scoped VMEM, which only Mosaic checks: preflight sees the error. The
    kernel's default cuts such chunks into query tiles that fit (``query_tile``: two of 256), which compile."""
    chip = one_chip("v5e")
    rng = np.random.default_rng(0)
    b, t, z = 1, 512, 16
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    args = (f(b, t, 9, 64), f(b, t, 3, 64), f(b, t, 3, 64), jnp.asarray(np.tril(np.ones((b, t, t), bool))),
            f(4, 3, z, 64), f(4, 3, z, 64), jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([20], jnp.int32))
    got = tree_attention(*args, sm_scale=0.125, interpret=True, query_tile_rows=t)
    ref = kernel_lib.ref_tree_attention(*args, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)  # interpret mode: fine
    one_tile = functools.partial(tree_attention, query_tile_rows=t)
    with pytest.raises(Exception) as err:
        compile_kernel(chip, groups=3, kv_heads=3, head_dim=64, t=t, page_size=z, dtype=jnp.float32, b=1,
                       fn=one_tile)
    assert "vmem" in str(err.value).lower()
    assert kernel_lib.query_tile(9, 64, jnp.float32, t) == 256
    assert tpu_unsupported_reason(9, 3, 64, z, jnp.float32, tree_tokens=t) is None
    compiled = compile_kernel(chip, groups=3, kv_heads=3, head_dim=64, t=t, page_size=z, dtype=jnp.float32, b=1)
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()


def test_unsupported_shape_falls_back_to_xla_with_a_logged_reason(caplog):
    """A head dim the kernel's lanes do not fit (32): the TPU hook runs the XLA path (and says why) instead of
    failing."""
    chip = one_chip("v5e")
    reason = tpu_unsupported_reason(6, 3, 32, 16, jnp.bfloat16)
    assert reason and "head_dim 32" in reason
    hook = make_cache_attention("auto", None, "tpu")
    hook_pkg._warned.clear()
    with caplog.at_level("WARNING", logger="specjax"):
        compiled = compile_kernel(chip, groups=2, kv_heads=3, head_dim=32, t=8, page_size=16, dtype=jnp.bfloat16,
                                  fn=lambda *a, sm_scale: hook(*a, sm_scale))
    assert "tpu_custom_call" not in compiled.as_text()
    assert any("XLA attention path" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_packed_pool_write_is_a_native_in_place_scatter():
    """The K/V write into a lane-packed pool (head dim 64, fp32: [L, P, K, 8, 128]) compiles for TPU to native scatters
    that update the donated pool in place: no serial loop (a half-row scatter at a dynamic lane offset was expanded
    into a while loop over every layer x token x head) and no pool-sized temporary."""
    chip = one_chip("v5e")
    sh = NamedSharding(Mesh([chip], ("x",)), P())
    s = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    shape = kv_cache.pool_shape(30, 4097, 3, 16, 64, jnp.float32)
    assert shape[-2:] == (8, 128)
    cache = kv_cache.KVCache(k=s(shape), v=s(shape), page_table=s((32, 513), jnp.int32), lengths=s((32,), jnp.int32))
    write = jax.jit(kv_cache.write, donate_argnums=0)
    with lowering_for("tpu"):
        compiled = write.lower(cache, s((30, 32, 8, 3, 64)), s((30, 32, 8, 3, 64)), s((32, 8), jnp.int32),
                               s((32, 8), jnp.bool_)).compile()
    text = compiled.as_text()
    assert "while(" not in text and "scatter(" in text
    pool_bytes = 2 * np.prod(shape) * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 0.01 * pool_bytes


def test_topology_names():
    one_chip("v4")
    topo = preflight.get_topology("v4-32")
    assert topo.chips == 16 and topo.generation == "v4" and topo.hbm_bytes == 32 * 2 ** 30
    assert preflight.get_topology("v5litepod-4").chips == 4
    with pytest.raises(preflight.PreflightError, match="unknown topology"):
        preflight.get_topology("v9-4")
    with pytest.raises(preflight.PreflightError, match="TensorCores"):
        preflight.get_topology("v4-3")


def test_preflight_train_step_small(capsys, default_precision):
    """The CLI path on a v5e-4 with the SmolLM2 recipe cut to 2 layers and short sequences: compiles, fits, and the
    table names the collectives."""
    one_chip("v5e")
    rc = preflight.main(["train", "--config", "smollm2-135m.yaml", "--topology", "v5e-4", "--num-layers", "2",
                         "--data.max_length", "128", "--data.buckets", "[128]", "--training.batch_size", "4",
                         "--training.grad_accum", "1", "--training.ttt_length", "2", "--head.draft_vocab_size",
                         "2048", "--mesh.tp", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "train step A=1 x B=4 x T=128" in out and "yes" in out and "all-reduce" in out


def test_preflight_train_rejects_a_mesh_that_does_not_fit_the_topology(capsys):
    one_chip("v5e")
    rc = preflight.main(["train", "--config", "smollm2-135m.yaml", "--topology", "v5e-4", "--mesh.tp", "3"])
    assert rc == 1 and "mesh" in capsys.readouterr().err


def test_shipped_configs_resolve_from_any_directory(tmp_path):
    assert configs.resolve("qwen2.5-7b.yaml").endswith("configs/qwen2.5-7b.yaml")
    assert os.path.samefile(configs.resolve("qwen2.5-7b"), configs.resolve("configs/qwen2.5-7b.yaml"))
    assert configs.model_config_json("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b.yaml").endswith("qwen2.5-7b.json")
    r = subprocess.run([sys.executable, "-m", "specjax.train", "--help"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "qwen2.5-7b.yaml" in r.stdout
    from specjax.train.config import load_config
    assert load_config("qwen2.5-7b.yaml").mesh.tp == 4


@pytest.mark.slow
def test_preflight_qwen25_7b_train_v4_32(capsys, default_precision):
    """The card's recipe, full size (minutes of CPU)."""
    one_chip("v4")
    assert preflight.main(["train", "--config", "qwen2.5-7b.yaml", "--topology", "v4-32"]) == 0
    assert "fits" in capsys.readouterr().out
