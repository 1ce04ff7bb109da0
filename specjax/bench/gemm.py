"""``python -m specjax.bench gemm``: the weight products of a decode step and of a verify (or batched) step, alone.

A forward over M new tokens multiplies M rows by every weight matrix of every layer: M = 1 in a batch-1 decode step,
M = the tree's tokens in a verify step, M = the batch in a batched decode step. This bench chains exactly those
products (q, k, v, o, gate, up, down per layer, then the tied lm_head) over a model's shapes, without attention, and
times the chain for each M in two weight layouts of XLA's own dots: [in, out] (``x @ W``) and [out, in] (PyTorch's
and GGUF's, ``x @ W.T``), and, where specjax's CPU kernels are built, in the layout a CPU decode step reads: the
kernels' products over packed panels (``packed``: ``cpu_dense.dense_packed``, the tied lm_head through
``cpu_dense.pack_table``). It prints ms per chain, the weight bytes read per second, and each M's cost against M = 1:
what a k-token verify costs over a decode step before any tree work, and which layout reads weights fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from specjax.bench.common import machine_description, print_table, report
from specjax.bench.decode import check_at_least, set_cpu_threads
from specjax.cli import option, parse_options

LAYOUTS = ("in_out", "out_in")


def _shapes(args) -> tuple[int, list[tuple[int, int]], int, int]:
    """(layers, the [in, out] shape of each matrix of a layer, hidden, vocab) of --model's config.json, or of
    SmolLM2-135M's."""
    if args.model is None:
        layers, d, q, kv, f, vocab = 30, 576, 576, 192, 1536, 49152
    else:
        from specjax.config import ConfigError, ModelConfig
        try:
            c = ModelConfig.from_pretrained(args.model)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        layers, d, q, kv, f, vocab = (c.num_layers, c.hidden_size, c.num_heads * c.head_dim,
                                      c.num_kv_heads * c.head_dim, c.intermediate_size, c.vocab_size)
    return layers, [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)], d, vocab


def _chain(layout: str):
    """A jitted forward-shaped chain of products over per-layer weights in ``layout`` (rms-normed between layers,
    so the values stay finite); the lm_head is [vocab, hidden] in the XLA layouts, as a tied embedding is stored,
    and packed as the decode layout packs a tied table in ``packed``."""
    import jax
    import jax.numpy as jnp

    from specjax.kernels import cpu_dense

    def mm(x, w):
        if layout == "packed":
            return cpu_dense.dense_packed(x, w)
        if layout == "in_out":
            return x @ w
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))

    def chain(x, weights, lm_head):
        for wq, wk, wv, wo, wg, wu, wd in weights:
            a = mm(x, wq) + jnp.concatenate([mm(x, wk), mm(x, wv)], -1).sum(-1, keepdims=True)
            x = x + mm(a, wo)
            x = x + mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        return mm(x, lm_head) if layout == "packed" else jax.lax.dot_general(x, lm_head, (((1,), (1,)), ((), ())))
    return jax.jit(chain)


def _packed_weights(weights, lm_head):
    """The in_out weights and the lm_head as the kernels' panels, or None where the kernels cannot take them (not
    built, disabled, or a width that is not a multiple of their panel)."""
    from specjax.kernels import cpu_dense
    table = cpu_dense.pack_table(lm_head)
    if table is None or not all(cpu_dense.packable(w) for ws in weights for w in ws):
        return None
    return [[cpu_dense.pack(w).panels for w in ws] for ws in weights], table.panels


def bench_gemm(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    layers, shapes, d, vocab = _shapes(args)
    rng = np.random.default_rng(0)
    host = [[(rng.standard_normal(s, np.float32) * 0.02) for s in shapes] for _ in range(layers)]
    weights = {"in_out": [[jnp.asarray(w) for w in ws] for ws in host],
               "out_in": [[jnp.asarray(np.ascontiguousarray(w.T)) for w in ws] for ws in host]}
    lm_head = jnp.asarray(rng.standard_normal((vocab, d), np.float32) * 0.02)
    heads = dict.fromkeys(LAYOUTS, lm_head)
    packed = _packed_weights(weights["in_out"], lm_head) if jax.default_backend() == "cpu" else None
    if packed is not None:
        weights["packed"], heads["packed"] = packed
    layouts = tuple(weights)
    nbytes = sum(w.nbytes for ws in host for w in ws) + lm_head.nbytes
    fns = {k: _chain(k) for k in layouts}
    rows = []
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, d), np.float32))
        outs = {k: fns[k](x, weights[k], heads[k]).block_until_ready() for k in layouts}  # compile, and check
        if not all(np.allclose(outs["in_out"], outs[k], atol=1e-3) for k in layouts):
            raise SystemExit("error: the layouts disagree (a bug in this bench)")
        best = dict.fromkeys(layouts, float("inf"))
        for _ in range(args.repeats):  # interleaved, fastest of the repeats
            for k in layouts:
                t0 = time.perf_counter()
                fns[k](x, weights[k], heads[k]).block_until_ready()
                best[k] = min(best[k], time.perf_counter() - t0)
        rows.append({"rows": m, **{f"{k}_s": best[k] for k in layouts}})
    return {"machine": machine_description(), "device": str(jax.devices()[0]), "threads": args.threads,
            "load_average": os.getloadavg()[0], "layers": layers, "weight_bytes": nbytes, "repeats": args.repeats,
            "layouts": list(layouts), "results": rows}


def print_gemm(res: dict) -> None:
    print(f"{res['layers']} layers, {res['weight_bytes'] / 1e6:.0f} MB of weights; {res['device']}, "
          f"{res['machine']}, threads {res['threads'] or 'default'}, load {res['load_average']:.1f}; fastest of "
          f"{res['repeats']}\n")
    layouts = res["layouts"]
    base = {k: res["results"][0][f"{k}_s"] for k in layouts}
    table = []
    for r in res["results"]:
        cells = [str(r["rows"])]
        for k in layouts:
            s = r[f"{k}_s"]
            cells += [f"{s * 1e3:.2f}", f"{res['weight_bytes'] / s / 1e9:.1f}", f"{s / base[k]:.2f}x"]
        cells.append(f"{r['out_in_s'] / r['in_out_s']:.2f}")
        table.append(cells)
    first = res["results"][0]["rows"]
    print_table(["rows M"] + [f"{k} {c}" for k in layouts for c in ("ms", "GB/s", f"vs M={first}")]
                + ["out_in / in_out"], table, align="---:")
    if "packed" not in layouts:
        print("\n(no 'packed' columns: specjax's CPU kernels are not built or not on, or the shapes do not fit their "
              "panels)")


@dataclasses.dataclass
class GemmOptions:
    model: str | None = option(None, metavar="PATH", help="HF folder whose shapes to use (default: SmolLM2-135M's "
                                                          "shapes; no weights are read)")
    rows: tuple[int, ...] = option((1, 2, 4, 8), help="rows M multiplied at once (1: a decode step; the first is the "
                                                      "baseline of the 'vs' columns)")
    repeats: int = option(20, help="timed repeats per cell, interleaved across layouts (fastest reported)")
    threads: int | None = option(None, help="XLA:CPU intra-op threads (default: XLA's own choice)")
    json: str | None = option(None, metavar="OUT", help="also write the results as JSON")


def main(argv=None) -> int:
    args = parse_options(GemmOptions, argv, "python -m specjax.bench gemm",
                         "The weight products of a forward over M rows, chained over a model's matrices, in the "
                         "[in, out] and [out, in] layouts: ms, GB/s and the cost against M = 1.",
                         formatter_class=argparse.HelpFormatter)
    check_at_least("--rows", min(args.rows, default=0), 1)
    check_at_least("--repeats", args.repeats, 1)
    if args.threads is not None:
        set_cpu_threads(args.threads)
    return report(args, bench_gemm, print_gemm)


if __name__ == "__main__":
    sys.exit(main())
