"""Plain greedy decode throughput: specjax (one jitted on-device loop) vs HF transformers (torch), same weights.

    python -m specjax.bench decode [--model PATH] [--batch-sizes 1 8] [--new-tokens 128] [--prompt-len 32]
                                   [--dtype float32|bfloat16] [--repeats 3] [--no-hf] [--vs llama.cpp] [--json OUT]
    python -m specjax.bench decode --random-llama-8b [--layers N] [--new-tokens 128] [--copy-mib 1024]

Both engines generate exactly ``--new-tokens`` tokens per row from the same equal-length prompts (HF with
``min_new_tokens`` so that eos cannot stop it early; specjax with no stop tokens). Two numbers per engine:
- generate tok/s: B * N / (wall time of the whole generate call, prompt prefill included);
- decode tok/s: B * (N - 1) / (t(N tokens) - t(1 token)), i.e. the per-token decode steps alone.
Each time is the fastest of ``--repeats`` interleaved runs (robust to a shared machine's stalls). Where t(N) - t(1)
is small against the repeats' spread (a long prompt, few new tokens), the decode rate comes with a warning.
The first specjax call of each shape compiles and is not timed; HF gets one untimed warm-up call too.

``--vs llama.cpp`` adds llama.cpp (``bench.llamacpp``) on a GGUF of the same weights (SmolLM2: the published Q4_1 file
dequantised to the bench's dtype), with the same thread count, its batched decode included, and, at batch 1, the
Q4_1 file itself (what a CPU user of llama.cpp runs). It also checks that its greedy tokens are specjax's.
Each engine's "of limit" is weight bytes per step x decode steps/s over the read bandwidth measured in the run: the
larger of one XLA matrix-vector product over a 256 MiB matrix (on every core the process may use: ``--threads T`` pins
it to T cores) and the same bytes streamed by the engines' thread count (``streaming_bandwidth``).

``--random-llama-8b`` measures what a GPU/TPU can do on a Llama-3.1-8B-shaped model with random bf16 weights: batch-1
decode tok/s and the fraction of the memory-bandwidth limit, ``weight bytes x tok/s / copy bandwidth``, where the
copy bandwidth (read + write bytes of ``x + 1`` on a --copy-mib uint32 buffer, the best of 5 calls of 10 passes) is
measured in the same run, and of the device kind's published bandwidth (``train_step.PEAK_HBM_GBPS``) where known.
``--layers`` shrinks the model so the code path also runs on a CPU. ``--profile-dir DIR`` then traces one more
generate call with the JAX profiler (``bench.profile``) and prints the device's time per token: busy against idle
between kernels, and the kernels that took the most (on an accelerator; a CPU trace has no device to read).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from specjax.bench.common import check_fits_device, machine_description, print_table, report
from specjax.bench.llamacpp import LlamaCppRunner
from specjax.bench.profile import print_summary, summarize, trace_call
from specjax.cli import option, parse_options

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json (architecture fields)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def make_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0, low: int = 100) -> list[list[int]]:
    """Equal-length prompts of ordinary (non-special) token ids; content does not change the cost of a decode step."""
    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab_size, size=(batch, prompt_len)).tolist()


def specjax_runner(params, cfg, prompts):
    """run(n): generate exactly n tokens per prompt with specjax (the jitted on-device loop), blocking; returns
    them."""
    import jax
    from specjax.generate import generate

    def run(n: int) -> list[list[int]]:
        out = generate(params, cfg, prompts, max_new_tokens=n, stop_token_ids=())
        assert all(len(o) == n for o in out)
        jax.effects_barrier()
        return [list(map(int, o)) for o in out]

    return run


def hf_runner(model, prompts, pad_token_id: int):
    """run(n): HF ``generate`` of exactly n greedy tokens per prompt (eos suppressed by min_new_tokens)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad_token_id)
        assert out.shape[1] == ids.shape[1] + n

    return run


def measure(runners: dict, batch: int, new_tokens: int, repeats: int) -> dict:
    """Rates of each runner. Warm-up (compile) first; then the timed runs of all engines are interleaved, so that a
    change of machine load (a shared CPU) hits every engine alike."""
    for run in runners.values():
        run(new_tokens), run(1)
    times = {name: {"full": [], "first": []} for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            for key, n in (("full", new_tokens), ("first", 1)):
                t0 = time.perf_counter()
                run(n)
                times[name][key].append(time.perf_counter() - t0)
    # The fastest of the repeats, not the median: on a shared CPU a stalled 1-token run (two spinning torch threads
    # descheduled) made the median t(1) exceed the median t(N) and HF's batch-8 decode rate came out as nan. Each
    # estimate is then the time the engine needs when it gets the cores, the same rule for every engine.
    return {name: _rates(batch, new_tokens, t["full"], t["first"], name) for name, t in times.items()}


def time_specjax(params, cfg, prompts, new_tokens: int, repeats: int) -> dict:
    return measure({"specjax": specjax_runner(params, cfg, prompts)}, len(prompts), new_tokens, repeats)["specjax"]


def _rates(batch: int, n: int, fulls: list[float], firsts: list[float], name: str = "specjax") -> dict:
    """Rates from the fastest of each engine's repeats. Decode tok/s comes from the difference t(N) - t(1), so
    where that window is small against the run-to-run spread of the two times (a long prompt's prefill, few new
    tokens), it is reported with a warning that says how far it can be off."""
    t_full, t_first = min(fulls), min(firsts)
    decode = batch * (n - 1) / (t_full - t_first) if n > 1 and t_full > t_first else float("nan")
    if n > 1 and t_full <= t_first:
        print(f"warning: t({n} tokens) {t_full:.3f}s <= t(1 token) {t_first:.3f}s: the machine's load swamped the "
              f"measurement; decode tok/s is not defined (raise --repeats)", file=sys.stderr)
    elif n > 1 and len(fulls) > 1:
        spread = sorted(fulls)[1] - t_full + sorted(firsts)[1] - t_first  # second fastest - fastest, both times
        if spread > 0.1 * (t_full - t_first):
            print(f"warning: {name}'s decode window t({n}) - t(1) = {t_full - t_first:.3f}s is small against the "
                  f"repeats' spread ({spread:.3f}s): its decode tok/s may be off by {spread / (t_full - t_first):.0%} "
                  f"(raise --new-tokens)", file=sys.stderr)
    return {"generate_s": t_full, "first_token_s": t_first, "generate_tok_s": batch * n / t_full,
            "decode_tok_s": decode}


def check_at_least(flag: str, value: int | None, least: int, why: str = "") -> None:
    """A ValueError naming ``flag`` when a count flag is below ``least`` (``python -m specjax.bench`` prints it as
    one line, exit status 2); None (a flag not given: its default applies) passes. ``why``: a note after the bound.
    The bench subcommands' check of their count flags, run before any work."""
    if value is not None and value < least:
        raise ValueError(f"{flag} must be >= {least}{why}, got {value}")


def set_cpu_threads(n: int) -> None:
    """Limit torch, XLA:CPU and specjax's CPU kernels to ``n`` threads, and (Linux) the process to ``n`` cores, so that
    every engine and the bandwidth measurements run on the same cores: XLA:CPU in JAX 0.10 spreads one large
    matrix-vector product over every core whatever ``intra_op_parallelism_threads`` says (33.6 GB/s on two cores of
    the Intel VM, 16.8 GB/s pinned to one). XLA reads its flags when the backend starts and the pools inherit the
    affinity when they start, so this must run before the first JAX computation (``main`` calls it first). ``n`` < 1
    is a ValueError naming --threads (torch's RuntimeError otherwise, after XLA's flags were set)."""
    check_at_least("--threads", n, 1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if 0 < n < len(cores):
        os.sched_setaffinity(0, cores[:n])
    os.environ["SPECJAX_CPU_THREADS"] = str(n)  # read when kernels.cpu_dense loads its library
    flags = os.environ.get("XLA_FLAGS", "")
    flags += f" --xla_cpu_multi_thread_eigen={'false' if n == 1 else 'true'} intra_op_parallelism_threads={n}"
    os.environ["XLA_FLAGS"] = flags.strip()
    try:
        import torch
        torch.set_num_threads(n)
    except ImportError:
        pass


def _resolve_model(args) -> str:
    if args.model is not None:
        return args.model
    from specjax.hub import default_smollm2_path
    path = default_smollm2_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"error: no model at {path}; run `python -m specjax.convert fetch-smollm2` "
                         "or pass --model PATH")
    return path


def _llamacpp_ggufs(args) -> dict:
    """{runner name: GGUF path} for --vs llama.cpp: the bench's weights, and the published Q4_1 file (batch 1)."""
    if args.vs is None:
        return {}
    if args.gguf is not None:
        return {"llama.cpp": args.gguf}
    if args.model is not None:
        raise SystemExit("error: --vs llama.cpp with --model needs --gguf PATH (a GGUF of the same weights)")
    from specjax.hub import fetch_smollm2_gguf
    return {"llama.cpp": fetch_smollm2_gguf(args.dtype), "llama.cpp Q4_1": fetch_smollm2_gguf("q4_1")}


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy agreement of two engines: rows identical, and the mean common prefix in tokens."""
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, theirs)]
    return {"rows_identical": sum(x == y for x, y in zip(ours, theirs)), "rows": len(ours),
            "mean_common_prefix": float(np.mean(prefix))}


def bench_model(args) -> dict:
    from specjax.weights import load_model

    if args.also_dtype is not None and args.also_dtype == args.dtype:
        raise SystemExit(f"error: --also-dtype {args.also_dtype} is --dtype already")
    model_path = _resolve_model(args)
    ggufs = _llamacpp_ggufs(args)
    threads = args.threads or os.cpu_count()
    print(f"machine: {machine_description()}", file=sys.stderr)
    print(f"loading {model_path} ({args.dtype})", file=sys.stderr)
    cfg, params = load_model(model_path, dtype=args.dtype, layout="decode")  # the weights read in place
    cfg.check_context(args.prompt_len, args.new_tokens, "lower --prompt-len or --new-tokens")
    other = None
    if args.also_dtype is not None:
        other_cfg, other = load_model(model_path, dtype=args.also_dtype, layout="decode")
    hf_model = None
    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).eval()
    pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    mib = 256 if args.copy_mib is None else args.copy_mib
    bw_product, bw_streams = read_bandwidth(mib), streaming_bandwidth(mib, threads)
    bw = max(bw_product, bw_streams)
    weight_bytes = decode_weight_bytes(params)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; {weight_bytes / 1e6:.0f} MB of weights per decode step",
          file=sys.stderr)
    rows = []
    for b in args.batch_sizes:
        prompts = make_prompts(cfg.vocab_size, b, args.prompt_len, seed=b)
        runners = {"specjax": specjax_runner(params, cfg, prompts)}
        if other is not None:
            runners["specjax also"] = specjax_runner(other, other_cfg, prompts)
        if hf_model is not None:
            runners["hf"] = hf_runner(hf_model, prompts, pad)
        for name, path in ggufs.items():
            if b == 1 or "Q4_1" not in name:
                runners[name] = LlamaCppRunner(path, prompts, threads, args.new_tokens)
        print(f"batch {b}: {', '.join(runners)} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        row = {"batch": b, **measure(runners, b, args.new_tokens, args.repeats), "load_avg_1min": os.getloadavg()[0]}
        ours = runners["specjax"](args.new_tokens) if "llama.cpp" in runners or other is not None else None
        if "llama.cpp" in runners:
            row["llama_agreement"] = _agreement(ours, runners["llama.cpp"](args.new_tokens))
        if other is not None:
            row["also_agreement"] = _agreement(ours, runners["specjax also"](args.new_tokens))
        rows.append(row)
        for run in runners.values():
            getattr(run, "close", lambda: None)()
        print(f"  {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return {"mode": "model", "model": model_path, "dtype": args.dtype, "also_dtype": args.also_dtype,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
            "machine": machine_description(), "rows": rows, "read_bandwidth_Bps": bw, "read_mib": mib,
            "product_read_Bps": bw_product, "stream_read_Bps": bw_streams, "stream_threads": threads,
            "weight_bytes_per_step": weight_bytes, "llamacpp_threads": threads if ggufs else None}


def print_model_table(res: dict) -> None:
    name = os.path.basename(os.path.normpath(res["model"]))
    threads = "default threads" if res["threads"] is None else f"{res['threads']} thread(s) per engine"
    if res.get("llamacpp_threads") and res["threads"] is None:
        threads += f" (llama.cpp: {res['llamacpp_threads']})"
    loads = ", ".join(f"{r['load_avg_1min']:.1f}" for r in res["rows"])
    print(f"\nPlain greedy decode: {name} ({res['dtype']}), prompt {res['prompt_len']} tokens, "
          f"{res['new_tokens']} new tokens, fastest of {res['repeats']}, {threads}")
    bw, wb = res["read_bandwidth_Bps"], res["weight_bytes_per_step"]
    print(f"machine: {res['machine']}; 1-min load average after each batch size: {loads}")
    print(f"weight-read limit: {bw / 1e9:.1f} GB/s read bandwidth (the larger of one matrix-vector product over a "
          f"{res['read_mib']} MiB f32 matrix, {res['product_read_Bps'] / 1e9:.1f} GB/s, and "
          f"{res['stream_threads']} threads streaming {res['read_mib']} MiB, {res['stream_read_Bps'] / 1e9:.1f} GB/s; "
          f"measured in this run) / {wb / 1e6:.0f} MB of weights per decode step = "
          f"{bw / wb:.1f} steps/s; 'of limit' = decode steps/s / that; prefill tok/s = batch x prompt tokens / "
          f"the time to the first new token\n")
    read_Bps = lambda r, e: r[e]["decode_tok_s"] / r["batch"] * wb  # weight bytes per second engine e read
    of_limit = lambda r, e: f"{100 * read_Bps(r, e) / bw:.0f}%"
    ratio = lambda r, e, key: f"{r['specjax'][key] / r[e][key]:.2f}x"
    columns = [("batch", lambda r: str(r["batch"])),
               ("specjax gen tok/s", lambda r: f"{r['specjax']['generate_tok_s']:.1f}"),
               ("specjax decode tok/s", lambda r: f"{r['specjax']['decode_tok_s']:.1f}"),
               ("specjax of limit", lambda r: of_limit(r, "specjax"))]
    prefill = lambda r, e: f"{r['batch'] * res['prompt_len'] / r[e]['first_token_s']:.0f}"
    columns += [("specjax prefill tok/s", lambda r: prefill(r, "specjax"))]
    also = res.get("also_dtype")
    if also is not None:
        columns += [(f"specjax {also} decode tok/s", lambda r: f"{r['specjax also']['decode_tok_s']:.1f}"),
                    (f"{also} / {res['dtype']}",
                     lambda r: f"{r['specjax also']['decode_tok_s'] / r['specjax']['decode_tok_s']:.2f}x"),
                    (f"same tokens as {res['dtype']}",
                     lambda r: "{rows_identical}/{rows}".format(**r["also_agreement"]))]
    if any("hf" in r for r in res["rows"]):
        columns += [("HF prefill tok/s", lambda r: prefill(r, "hf")),
                    ("HF gen tok/s", lambda r: f"{r['hf']['generate_tok_s']:.1f}"),
                    ("HF decode tok/s", lambda r: f"{r['hf']['decode_tok_s']:.1f}"),
                    ("gen ratio", lambda r: ratio(r, "hf", "generate_tok_s")),
                    ("decode ratio", lambda r: ratio(r, "hf", "decode_tok_s"))]
    if any("llama.cpp" in r for r in res["rows"]):
        columns += [("llama.cpp prefill tok/s", lambda r: prefill(r, "llama.cpp")),
                    ("llama.cpp decode tok/s", lambda r: f"{r['llama.cpp']['decode_tok_s']:.1f}"),
                    ("llama.cpp of limit", lambda r: of_limit(r, "llama.cpp")),
                    ("specjax / llama.cpp", lambda r: ratio(r, "llama.cpp", "decode_tok_s")),
                    ("same tokens", lambda r: "{rows_identical}/{rows}".format(**r["llama_agreement"])),
                    ("llama.cpp Q4_1 decode tok/s",
                     lambda r: f"{r['llama.cpp Q4_1']['decode_tok_s']:.1f}" if "llama.cpp Q4_1" in r else "-")]
    print("| " + " | ".join(c for c, _ in columns) + " |")
    print("|" + "|".join("---:" for _ in columns) + "|")
    for r in res["rows"]:
        print("| " + " | ".join(cell(r) for _, cell in columns) + " |")
    rates = [read_Bps(r, e) for r in res["rows"] for e in ("specjax", "llama.cpp") if e in r]
    fastest = max((x for x in rates if np.isfinite(x)), default=0.0)  # nan: a run too short to time its decode
    if fastest > bw:
        print(f"\nnote: an engine read its weights at {fastest / 1e9:.1f} GB/s, faster than the probes above: on this "
              f"machine they measure less than the memory gives, so 'of limit' over 100% means the limit is "
              f"understated, not exceeded.")


# ---- Llama-3.1-8B-shaped random model ---------------------------------------------------------------------------

def random_llama_config(layers: int | None, dtype: str = "bfloat16"):
    """The Llama-3.1-8B shape (``layers`` of its 32 layers when given) in ``dtype``; a clear exit when ``layers`` is
    not positive or its weights cannot fit the default device (a CPU's available memory)."""
    import math

    import jax
    import jax.numpy as jnp
    from specjax.config import ModelConfig
    from specjax.models import target
    if layers is not None and layers < 1:
        raise SystemExit(f"error: --layers must be >= 1, got {layers}")
    hf = dict(LLAMA_31_8B)
    if layers:
        hf["num_hidden_layers"] = layers
    cfg = ModelConfig.from_hf_dict(hf, dtype=dtype)
    largest = max(math.prod(x.shape) for x in jax.tree.leaves(target.param_shapes(cfg)))
    # ``random_params`` draws each stacked leaf in one jitted call: XLA:CPU held 16 bytes per element of the largest
    # one beside the weights (30.1 GB for the 8B shape's [32, 4096, 14336] matrices)
    check_fits_device(cfg.num_params() * jnp.dtype(cfg.dtype).itemsize + 16 * largest,
                      f"the random Llama-3.1-8B-shaped model ({cfg.num_layers} layers, {cfg.dtype}, with the random "
                      f"draw of its largest matrix)", "--layers N builds fewer of its 32 layers")
    return cfg


def random_params(cfg, seed: int = 0, scale: float = 0.02):
    """Random params generated directly in cfg.dtype on the default device (no float32 copy of an 8B model)."""
    import jax
    import jax.numpy as jnp
    from specjax.models import random_params as init, target

    def normal(k, shape, dt, scale):
        return jax.jit(lambda k: jax.random.normal(k, shape, dt) * jnp.asarray(scale, dt))(k)  # bf16 throughout

    params = init(target.param_shapes(cfg), jax.random.PRNGKey(seed), scale, normal=normal)
    jax.block_until_ready(params)
    return params


def decode_weight_bytes(params) -> int:
    """Bytes of weights one decode step must read: every weight, less the embedding table unless the logits read it
    (a tied lm_head without the decode layout's panels of it)."""
    import jax
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(dataclasses.replace(params, embed_bits=None)))
    reads_table = params.lm_head is None and getattr(params, "embed_panels", None) is None
    return total if reads_table else total - params.embed.nbytes


def read_bandwidth(mib: int, repeats: int = 10) -> float:
    """Bytes/s with which one matrix-vector product streams a ``mib`` MiB float32 matrix on the default device.

    A batch-1 decode step is a chain of such products over the weights, so this is its weight-read ceiling on a
    CPU. (``copy_bandwidth`` is no CPU measure: its fresh 256 MiB output is page-faulted in on every call, 3 GB/s.)"""
    import jax
    import jax.numpy as jnp
    m = jnp.ones((mib * (1 << 20) // 4096, 1024), jnp.float32)
    v = jnp.ones((1024,), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(m, v))
    best = min(_time_once(lambda: jax.block_until_ready(f(m, v))) for _ in range(repeats))
    return m.nbytes / best


def streaming_bandwidth(mib: int, threads: int, repeats: int = 5) -> float:
    """Bytes/s with which ``threads`` CPU threads together read ``mib`` MiB of float32, each a dot product of its own
    share with itself (numpy releases the GIL): what the machine's memory gives an engine using that many threads.
    On some CPUs XLA's product reads less than the engines' threads do together (docs/benchmarks.md, fifteenth
    session), so the limit is the larger of the two."""
    import threading

    import numpy as np
    parts = [np.ones(mib * (1 << 20) // 4 // threads, np.float32) for _ in range(threads)]

    def once() -> float:
        workers = [threading.Thread(target=np.dot, args=(p, p)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - t0

    once()
    return sum(p.nbytes for p in parts) / min(once() for _ in range(repeats))


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(mib: int, repeats: int = 5, passes: int = 10) -> float:
    """Bytes/s of ``x + 1`` over a ``mib`` MiB uint32 buffer on the default device (read + write bytes counted).

    An integer add is free next to the memory traffic on every backend, so this is the device's streaming bandwidth:
    the ceiling for a decode step that must read every weight once. One call runs ``passes`` dependent passes in an
    on-device loop over a donated buffer, so that neither the dispatch nor a fresh output's allocation is timed, and
    the best of ``repeats`` calls is reported, as the decode figure it bounds is the best of its runs (a median of
    single passes read 1.84 TB/s on an H200 where 2.66 TB/s had been read before, below the decode it bounds)."""
    import jax
    import jax.numpy as jnp
    x = jnp.zeros((mib * (1 << 20) // 4,), jnp.uint32)
    nbytes = x.nbytes
    f = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda _, b: b + jnp.uint32(1), a), donate_argnums=0)
    x = jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes * passes / best


def bench_random_llama(args) -> dict:
    import jax

    from specjax.models import target
    from specjax.train.train_step import peak_hbm_gbps

    cfg = random_llama_config(args.layers)
    cfg.check_context(args.prompt_len, args.new_tokens, "lower --prompt-len or --new-tokens")
    print(f"machine: {machine_description()}", file=sys.stderr)
    print(f"random Llama-3.1-8B-shaped model: {cfg.num_layers} layers, {cfg.num_params() / 1e9:.2f}B params, bf16",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    params = target.unstack_layers(random_params(cfg))
    print(f"  initialised in {time.perf_counter() - t0:.1f}s; measuring copy bandwidth ...", file=sys.stderr,
          flush=True)
    bw = copy_bandwidth(args.copy_mib)
    weight_bytes = decode_weight_bytes(params)
    prompts = make_prompts(cfg.vocab_size, 1, args.prompt_len)
    print("  decoding ...", file=sys.stderr, flush=True)
    rates = time_specjax(params, cfg, prompts, args.new_tokens, args.repeats)
    moved = weight_bytes * rates["decode_tok_s"]  # bytes/s the decode read
    trace = None
    if args.profile_dir:
        run = specjax_runner(params, cfg, prompts)
        path = trace_call(lambda: run(args.new_tokens), args.profile_dir)
        try:
            trace = summarize(path, args.new_tokens) | {"path": path}
        except ValueError as e:
            print(f"  profile: {e}", file=sys.stderr)
    kind = jax.devices()[0].device_kind
    published = peak_hbm_gbps(kind)
    published_bps = published[0] * 1e9 if published else None
    return {"device_kind": kind, "published_bandwidth_Bps": published_bps,
            "published_fraction": moved / published_bps if published_bps else None,
            "mode": "random-llama-8b", "layers": cfg.num_layers, "params": cfg.num_params(),
            "weight_bytes_per_token": weight_bytes, "copy_bandwidth_Bps": bw, "copy_mib": args.copy_mib,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "machine": machine_description(), "specjax": rates, "bandwidth_fraction": moved / bw,
            "bandwidth_limit_tok_s": bw / weight_bytes, "trace": trace}


def print_random_llama(res: dict) -> None:
    r = res["specjax"]
    print(f"\nRandom Llama-3.1-8B-shaped model ({res['layers']} layers, {res['params'] / 1e9:.2f}B params, bf16), "
          f"batch 1, prompt {res['prompt_len']}, {res['new_tokens']} new tokens, fastest of {res['repeats']}")
    print(f"machine: {res['machine']}\n")
    published = res.get("published_bandwidth_Bps")
    # The datasheet bandwidth is the ceiling; the in-run copy is a measured floor of what the memory gives (a short
    # copy can read slower than the decode itself), so its fraction is reported second.
    print_table(["decode tok/s", "generate tok/s", "weight GB/token", "published GB/s", "fraction of published",
                 "in-run copy GB/s", "copy-bound tok/s", "fraction of the copy"],
                [[f"{r['decode_tok_s']:.2f}", f"{r['generate_tok_s']:.2f}",
                  f"{res['weight_bytes_per_token'] / 1e9:.2f}", f"{published / 1e9:.0f}" if published else "-",
                  f"{100 * res['published_fraction']:.1f}%" if published else "-",
                  f"{res['copy_bandwidth_Bps'] / 1e9:.1f}", f"{res['bandwidth_limit_tok_s']:.2f}",
                  f"{100 * res['bandwidth_fraction']:.1f}%"]], align="---:")
    if res.get("trace"):
        t = res["trace"]
        print_summary(t, "token (prefill included)")
        busy_gbps = res["weight_bytes_per_token"] / t["busy_ms_per_unit"] / 1e6
        print(f"\nweights read while the device was busy (prefill included): {busy_gbps:.0f} GB/s; trace: {t['path']}")


@dataclasses.dataclass
class DecodeOptions:
    model: str | None = option(None, metavar="PATH", help="HF folder (default: the SmolLM2 cache of `python -m "
                                                          "specjax.convert fetch-smollm2`)")
    batch_sizes: tuple[int, ...] = option((1, 8), help="batch sizes to measure, one table row each")
    new_tokens: int = option(128, help="tokens decoded per measurement")
    prompt_len: int = option(32, help="prompt tokens per row")
    dtype: str = option("float32", choices=("float32", "bfloat16"), help="weight and activation dtype of both engines")
    repeats: int = option(3, help="timed repeats per measurement, interleaved across engines (the fastest is reported)")
    no_hf: bool = option(False, help="skip the transformers baseline")
    also_dtype: str | None = option(None, choices=("float32", "bfloat16"),
                                    help="also run specjax with these weights and activations in the same run, "
                                         "interleaved with the others: the dtype ratio from one run, and its greedy "
                                         "agreement with --dtype")
    vs: str | None = option(None, choices=("llama.cpp",), help="also run llama.cpp on the same weights and threads "
                                                               "(needs llama-cpp-python)")
    gguf: str | None = option(None, metavar="PATH", help="with --vs llama.cpp and --model: a GGUF of the same weights "
                                                         "(default: SmolLM2's, fetched and dequantised)")
    random_llama_8b: bool = option(False, help="random bf16 Llama-3.1-8B-shaped model, batch 1, fraction of the "
                                               "bandwidth limit")
    layers: int | None = option(None, help="with --random-llama-8b: override the 32 layers")
    profile_dir: str | None = option(None, metavar="DIR",
                                     help="with --random-llama-8b: trace one more generate call with the JAX profiler "
                                          "into DIR and print the device's time per token by kernel")
    copy_mib: int | None = option(None, help="buffer size of the bandwidth measurement (default 1024 on "
                                             "accelerators, 256 on CPU); both modes report the weight-read limit")
    threads: int | None = option(None, help="CPU threads for every engine (torch.set_num_threads, XLA's intra-op "
                                            "pool, llama.cpp's threads), the process pinned to that many cores "
                                            "(Linux); "
                                            "default: each library's own choice. On a shared, oversubscribed CPU, 1 "
                                            "gives stable numbers")
    json: str | None = option(None, metavar="OUT", help="also write the results as JSON")


def _check_counts(args) -> None:
    """Every count flag of ``bench decode``, before any work: --batch-sizes 0 was a ZeroDivisionError after the whole
    run, --repeats 0 an empty min() after it, --copy-mib -5 a JAX traceback and --copy-mib 0 silently 256."""
    for flag, value in (("--batch-sizes", min(args.batch_sizes)), ("--prompt-len", args.prompt_len),
                        ("--repeats", args.repeats), ("--copy-mib", args.copy_mib), ("--threads", args.threads)):
        check_at_least(flag, value, 1)
    check_at_least("--new-tokens", args.new_tokens, 2, " (decode tok/s is measured against a 1-token run)")


def main(argv=None) -> int:
    args = parse_options(DecodeOptions, argv, "python -m specjax.bench decode",
                         "Plain greedy decode tokens/s: specjax vs HF transformers.",
                         formatter_class=argparse.HelpFormatter)
    _check_counts(args)
    if args.threads is not None:
        set_cpu_threads(args.threads)
    if not args.random_llama_8b:
        if args.profile_dir:
            raise SystemExit("error: --profile-dir goes with --random-llama-8b")
        return report(args, bench_model, print_model_table)
    import jax
    if args.copy_mib is None:
        args.copy_mib = 256 if jax.devices()[0].platform == "cpu" else 1024
    return report(args, bench_random_llama, print_random_llama)


if __name__ == "__main__":
    sys.exit(main())
