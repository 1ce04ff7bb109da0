"""EAGLE3 train-step benchmark: tokens/s, step time and MFU, with random target weights of a given shape.

    python -m specjax.bench train --model-config smollm2-135m --batch 4 --seq-len 256 --steps 5
    python -m specjax.bench train --model-config configs/models/qwen2.5-7b.json --batch 16 --seq-len 1024 --tp 4
    python -m specjax.bench train --config configs/smollm2-135m.yaml --steps 10

``--model-config`` takes an HF config.json (or its folder) or a preset name (``smollm2-135m``); ``--config`` takes a
training YAML and uses its model, batch, grad-accum, TTT, head and mesh settings (flags override them). Nothing is
read from disk but the config: the target's weights are random (same shapes, same FLOPs), the batch is random
tokens with full attention and loss masks.

FLOPs per token come from ``specjax.train.train_step.estimate_flops_per_token`` (frozen target forward + head
forward/backward over the TTT rollout); MFU = FLOPs/token x tokens/s / (peak x devices). Peak: dense bf16 FLOP/s
per device from ``train_step.PEAK_TFLOPS`` by device kind, or ``--peak-tflops``. On a CPU the peak is measured in
the same run, before and after the steps (the faster kept):
the faster of one large fp32 matmul and one of bf16 operands accumulated in f32 (what the CPU can do at best; on an
AMX Xeon the bf16 one is 5x the fp32 one). Every run also prints the fraction of each measured peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from specjax import configs
from specjax.bench.common import print_table
from specjax.cli import check_output_file, option, parse_options
from specjax.config import DTYPES

CPU_NOMINAL_TFLOPS = 1.0

PRESETS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the fields that shape the model)
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                         hidden_act="silu", torch_dtype="bfloat16"),
}


def measured_matmul_tflops(dtype: str, n: int | None = None, repeats: int = 3) -> float:
    """TFLOP/s of one square n x n matmul of ``dtype`` operands accumulated in f32 (as published bf16 peaks are
    quoted) on the default device, the fastest of ``repeats`` (after a compile + warm-up call): the machine's
    achievable matmul peak, measured in the same run as the train step. (On an AMX Xeon XLA:CPU ran a bf16 product
    with a bf16 result at 0.25 TFLOP/s, with an f32 result at 1.3-1.4: thirty-seventh session.)"""
    import jax
    import jax.numpy as jnp
    n = n or (2048 if jax.devices()[0].platform == "cpu" else 8192)
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(x, x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, x))
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def peak_tflops(device_kind: str, platform: str) -> tuple[float, str]:
    from specjax.train.train_step import peak_tflops as table_peak
    if found := table_peak(device_kind):
        return found[0], f"{found[1]} dense bf16"
    if platform == "cpu":
        return CPU_NOMINAL_TFLOPS, "nominal CPU figure (not a real peak)"
    return float("nan"), f"unknown device {device_kind!r}: pass --peak-tflops"


@dataclasses.dataclass
class TrainBenchOptions:
    config: str | None = option(None, one_of="source",
                                help="training YAML (model, batch, grad_accum, TTT, head, mesh)")
    model_config: str | None = option(None, one_of="source",
                                      help=f"HF config.json / folder, or a preset: {', '.join(PRESETS)}")
    batch: int | None = option(None, help="global micro-batch (sequences); default 4 or the YAML's")
    seq_len: int | None = option(None, help="tokens per sequence; default 512 or the YAML's data.max_length")
    steps: int = option(5, help="timed steps (after --warmup)")
    warmup: int = option(2, help="untimed steps, the first one compiles")
    grad_accum: int | None = option(None, help="micro-batches per step (default 1 or the YAML's)")
    ttt_length: int | None = option(None, help="TTT rollout length (default 7 or the YAML's)")
    draft_vocab: int | None = option(None, help="draft vocab size (default 32000 or the YAML's)")
    head_layers: int | None = option(None, help="head layers (default 1 or the YAML's)")
    dtype: str | None = option(None, help="target dtype (default: bfloat16 on accelerators, float32 on CPU)")
    head_dtype: str | None = option(None, help="head compute dtype (default: same as --dtype); master weights "
                                               "are fp32")
    dp: int | None = option(None, help="data-parallel size (default: all devices / tp)")
    tp: int | None = option(None, help="tensor-parallel size (default 1 or the YAML's)")
    head_sharding: str = option("tp", choices=("tp", "replicated"),
                                help="split the head's matrices over tp, or replicate them")
    peak_tflops: float | None = option(None, help="peak TFLOP/s per device for MFU (overrides the table)")
    json: str | None = option(None, help="append the result as one JSON line to this file")


def _args(argv):
    return parse_options(TrainBenchOptions, argv, "python -m specjax.bench train", __doc__.split("\n\n")[0],
                         formatter_class=argparse.HelpFormatter)


def _check(a):
    """The options, or a ValueError naming the first one out of range (before anything loads or compiles)."""
    check_output_file(a.json, "--json")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    for name in ("batch", "seq_len", "steps", "grad_accum", "ttt_length", "draft_vocab", "head_layers",
                 "dp", "tp"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("dtype", "head_dtype"):
        if getattr(a, name) is not None and getattr(a, name) not in DTYPES:
            raise ValueError(f"--{name.replace('_', '-')} must be float32, bfloat16 or float16, "
                             f"got {getattr(a, name)!r}")
    return a


def _resolve(a):
    """(HF config dict, settings) from --config / --model-config and the flags."""
    s = dict(batch=4, seq_len=512, grad_accum=1, ttt_length=7, draft_vocab=32000, head_layers=1, tp=1, dp=None,
             dtype=None)
    if a.config:
        from specjax.train.config import load_config
        cfg = load_config(a.config)
        cfg_json = configs.model_config_json(cfg.model.path, a.config)
        if cfg_json is None:
            raise SystemExit(f"error: {a.config}: model.path {cfg.model.path} has no config.json here; fetch the model "
                             f"or pass --model-config with its config.json (or a preset: {', '.join(PRESETS)})")
        with open(cfg_json) as f:
            hf = json.load(f)
        s.update(batch=cfg.training.batch_size, seq_len=cfg.data.max_length, grad_accum=cfg.training.grad_accum,
                 ttt_length=cfg.training.ttt_length, draft_vocab=cfg.head.draft_vocab_size,
                 head_layers=cfg.head.num_layers, tp=cfg.mesh.tp, dp=cfg.mesh.dp if cfg.mesh.dp > 0 else None,
                 dtype=cfg.model.dtype)
        name = os.path.basename(a.config)
    elif a.model_config in PRESETS:
        hf, name = dict(PRESETS[a.model_config]), a.model_config
    else:
        p = a.model_config if a.model_config.endswith(".json") else os.path.join(a.model_config, "config.json")
        p = p if os.path.exists(p) else configs.model_shape(a.model_config) or p
        with open(p) as f:
            hf = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(p))) if not a.model_config.endswith(".json") \
            else os.path.basename(p)[:-5]
    for k_arg, k in (("batch", "batch"), ("seq_len", "seq_len"), ("grad_accum", "grad_accum"),
                     ("ttt_length", "ttt_length"), ("draft_vocab", "draft_vocab"), ("head_layers", "head_layers"),
                     ("tp", "tp"), ("dp", "dp"), ("dtype", "dtype")):
        if getattr(a, k_arg) is not None:
            s[k] = getattr(a, k_arg)
    return hf, s, name


def time_steps(step, state, tparams, vmap, batch, warmup: int, steps: int):
    """(compile seconds, seconds per timed step, last metrics): ``warmup`` untimed steps (the first compiles), then
    ``steps`` timed ones."""
    import jax
    t0 = time.perf_counter()
    for i in range(max(warmup, 1)):
        state, m = step(state, tparams, vmap, batch)
        jax.block_until_ready(m)
        if i == 0:
            compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, tparams, vmap, batch)
    jax.block_until_ready((state, m))
    return compile_s, (time.perf_counter() - t1) / max(steps, 1), m


def print_result(res: dict, tokens: int, peak: float, exact: dict) -> None:
    """The table; ``exact`` holds the unrounded step_s, tok_s, fpt, head_share, achieved, mfu, measured and
    frac_measured that ``res`` (the JSON line) rounds."""
    name, n_dev, dev_kind = res["model"], res["devices"], res["device"]
    fpt, head_share, achieved = exact["fpt"], exact["head_share"], exact["achieved"]
    print(f"EAGLE3 train step: {name} ({res['target_params_m']}M-param target, random weights), {n_dev} x "
          f"{dev_kind} (dp={res['dp']}, tp={res['tp']}), B={res['batch']} x T={res['seq_len']} x "
          f"A={res['grad_accum']}, TTT {res['ttt_length']}, draft vocab {res['draft_vocab']}, target {res['dtype']} "
          f"/ head {res['head_dtype']}; compile {res['compile_s']:.1f} s")
    print_table(["tokens/step", "step time (ms)", "tokens/s", "GFLOP/token (head share)", "achieved TFLOP/s", "MFU"],
                [[tokens, f"{exact['step_s'] * 1e3:.1f}", f"{exact['tok_s']:,.0f}",
                  f"{fpt / 1e9:.2f} ({head_share:.0%})", f"{achieved:.3f}", f"{exact['mfu']:.1%}"]])
    print(f"MFU against {peak:g} TFLOP/s per device ({res['peak_source']}).")
    print("Measured matmul peak per device (one square matmul, this run): "
          + ", ".join(f"{d} {v:.3f} TFLOP/s (train step = {exact['frac_measured'][d]:.1%} of it)"
                      for d, v in exact["measured"].items())
          + f"; 1-min load average {os.getloadavg()[0]:.1f}.")


def timed_with_peaks(step, state, tparams, vmap, batch, warmup: int, steps: int):
    """``time_steps`` plus the fp32 and bf16 matmul peaks (``measured_matmul_tflops``), measured on both sides of the
    steps and the faster kept: a probe slowed by the host (0.18-0.47 TFLOP/s on one VM) would inflate the MFU it
    divides. Returns (compile s, step s, metrics, {dtype: TFLOP/s})."""
    before = {d: measured_matmul_tflops(d) for d in ("float32", "bfloat16")}
    compile_s, step_s, m = time_steps(step, state, tparams, vmap, batch, warmup, steps)
    return compile_s, step_s, m, {d: max(before[d], measured_matmul_tflops(d)) for d in before}


def main(argv=None) -> int:
    a = _check(_args(list(sys.argv[1:] if argv is None else argv)))
    hf, s, name = _resolve(a)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import weights
    from specjax.config import ModelConfig
    from specjax.host import reuse_cpu_temps
    from specjax.models import eagle3, target
    from specjax.sharding import make_mesh
    from specjax.train import train_step as S

    reuse_cpu_temps()  # as the trainer runs
    dev = jax.devices()[0]
    dtype = s["dtype"] or ("float32" if dev.platform == "cpu" else "bfloat16")
    tcfg = ModelConfig.from_hf_dict(hf, dtype=dtype)
    hcfg = eagle3.Eagle3Config.from_target(tcfg, draft_vocab_size=s["draft_vocab"], num_layers=s["head_layers"],
                                           dtype=a.head_dtype or dtype)
    tp = s["tp"]
    dp = s["dp"] or jax.device_count() // tp
    mesh = make_mesh(dp=dp, tp=tp, devices=jax.devices()[:dp * tp]) if dp * tp > 1 else None
    b, t, acc, ttt = s["batch"], s["seq_len"], s["grad_accum"], s["ttt_length"]
    if b % dp:
        raise SystemExit(f"error: --batch {b} must be divisible by dp={dp}")

    key = jax.random.PRNGKey(0)
    init = lambda k: target.init_params(tcfg, k)
    tparams = (jax.jit(init)(key) if mesh is None
               else jax.jit(init, out_shardings=weights.param_shardings(tcfg, mesh))(key))
    tparams = target.stacked_bits(tparams, tcfg)  # as the trainer holds it
    used = np.arange(hcfg.draft_vocab_size) * (tcfg.vocab_size // hcfg.draft_vocab_size)
    vmap = eagle3.VocabMap.from_used_ids(used, tcfg.vocab_size)
    opt = S.make_optimizer(lr=1e-4, total_steps=1000, warmup_ratio=0.0)
    state = S.init_train_state(hcfg, 0, opt, mesh, head_sharding=a.head_sharding)
    step = S.make_train_step(tcfg, hcfg, opt, mesh, ttt_length=ttt, grad_accum=acc, head_sharding=a.head_sharding)
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, tcfg.vocab_size, (acc, b, t), dtype=np.int32),
             "loss_mask": np.ones((acc, b, t), np.int32), "attention_mask": np.ones((acc, b, t), np.int32)}
    if mesh is not None:
        rep = NamedSharding(mesh, P())
        batch = jax.device_put(batch, NamedSharding(mesh, P(None, "dp")))
        vmap = jax.device_put(vmap, rep)
    else:
        batch = jax.device_put(batch)

    compile_s, step_s, m, measured = timed_with_peaks(step, state, tparams, vmap, batch, a.warmup, a.steps)

    n_dev = dp * tp
    tokens = acc * b * t
    tok_s = tokens / step_s
    fpt = S.estimate_flops_per_token(tcfg, hcfg, t, ttt)
    head_share = S.estimate_flops_per_token(tcfg, hcfg, t, ttt, include_target=False) / fpt
    peak, peak_src = (a.peak_tflops, "--peak-tflops") if a.peak_tflops else peak_tflops(dev.device_kind, dev.platform)
    if dev.platform == "cpu" and not a.peak_tflops:
        best = max(measured, key=measured.get)
        peak, peak_src = measured[best], f"the faster of the fp32 and bf16 matmuls measured in this run: {best}"
    achieved = fpt * tok_s / 1e12
    mfu = achieved / (peak * n_dev)
    frac_measured = {d: achieved / (v * n_dev) for d, v in measured.items()}
    res = dict(model=name, target_params_m=round(tcfg.num_params() / 1e6, 1), device=dev.device_kind,
               platform=dev.platform, devices=n_dev, dp=dp, tp=tp, batch=b, seq_len=t, grad_accum=acc, ttt_length=ttt,
               draft_vocab=hcfg.draft_vocab_size, dtype=dtype, head_dtype=hcfg.dtype, compile_s=round(compile_s, 1),
               step_ms=round(step_s * 1e3, 1), tokens_per_s=round(tok_s, 1),
               gflop_per_token=round(fpt / 1e9, 3), head_flop_share=round(head_share, 3),
               achieved_tflops=round(achieved, 4), peak_tflops_per_device=peak, peak_source=peak_src,
               mfu=round(mfu, 4), loss=round(float(m["loss"]), 4),
               measured_matmul_tflops={d: round(v, 4) for d, v in measured.items()},
               fraction_of_measured={d: round(v, 4) for d, v in frac_measured.items()},
               load_avg_1min=round(os.getloadavg()[0], 2))
    print_result(res, tokens, peak, dict(step_s=step_s, tok_s=tok_s, fpt=fpt, head_share=head_share, achieved=achieved,
                                         mfu=mfu, measured=measured, frac_measured=frac_measured))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
