"""Plain (non-speculative) generation: the reference output that speculative decoding must reproduce.

A batch of prompts of different lengths is right-padded and prefilled (``decode.prefill`` with a valid mask, in the
chunks of ``batching.prefill_chunks``, as speculative decoding prefills); the decode loop then runs as ONE jitted
``lax.while_loop`` (no host round-trip per token) in which each row stops on its own stop token or after
``max_new_tokens``, and the loop ends as soon as every row is done.

Output convention (matches HF ``model.generate``): the generated tokens only (no prompt), INCLUDING the stop token
that ended a row; a row that hits ``max_new_tokens`` has exactly that many tokens.

    python -m specjax.generate --model ./SmolLM2-135M-Instruct --chat --prompt "What is JAX?"
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import kv_cache, plain_step as decode, sampling
from specjax.batching import capacity_for, prefill_chunks, prefill_plan, validate_requests, warmup_budget
from specjax.cli import option, options_parser, parse_into
from specjax.config import ConfigError, ModelConfig
from specjax.head_weights import check_token_map_use, load_draft
from specjax.heads import DEFAULT_ALGORITHM, DEFAULT_HEAD, default_head_available
from specjax.hub import FetchError, default_smollm2_path, enable_compilation_cache, fetch_smollm2
from specjax.models import target
from specjax.safetensors_io import SafetensorsError
from specjax.sharding import committed_device, put_kv_pool, use_mesh
from specjax.speculative.draft import make_draft
from specjax.speculative.spec_generate import speculative_generate
from specjax.speculative.tree import num_candidates, validate as validate_tree
from specjax.speculative.tune import TuneError, load_tune, shape_for, table_path, tuned_elsewhere
from specjax.weights import WeightsError, load_model, load_tokenizer, resolve_model_path, stop_token_ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    """State of the on-device decode loop."""
    cache: kv_cache.KVCache  # paged KV cache; holds every token fed to the model so far
    out: jax.Array  # i32[B, M]  generated tokens per row (M >= every row's budget); slots past ``count`` unused
    last: jax.Array  # i32[B]  the latest generated token of each row (the next decode input)
    count: jax.Array  # i32[B]  generated tokens per row so far
    limit: jax.Array  # i32[B]  token budget of each row (max_new_tokens)
    done: jax.Array  # bool[B]  row finished (stop token emitted or budget spent)
    sampling: sampling.SamplingBatch  # per-row sampling parameters and PRNG keys


def _record(state: LoopState, tok, active, stop_ids) -> LoopState:
    """Append ``tok`` (i32[B]) to the rows that are ``active`` (bool[B]) and update which rows are done."""
    b, m = state.out.shape
    col = jnp.where(active, state.count, m)  # out-of-range column for inactive rows: dropped by the scatter
    out = state.out.at[jnp.arange(b), col].set(tok, mode="drop")  # i32[B, M]
    count = state.count + active.astype(jnp.int32)
    is_stop = (tok[:, None] == stop_ids[None, :]).any(-1)  # bool[B]
    done = state.done | (active & is_stop) | (count >= state.limit)
    last = jnp.where(active, tok, state.last)
    return dataclasses.replace(state, out=out, count=count, done=done, last=last)


@functools.partial(jax.jit, static_argnames=("cfg", "cache_attention"), donate_argnames=("cache", "logits"))
def _prefill_chunk(params, cfg: ModelConfig, cache, tokens, valid, last, logits, *, cache_attention=None):
    """Append one prompt chunk per row (tokens i32[B, T], valid bool[B, T]); rows whose prompt ends in this chunk
    (``last`` bool[B]) take its logits at their last token into ``logits`` f32[B, V]."""
    cache, out = decode.prefill(params, cfg, cache, tokens, valid, cache_attention=cache_attention)
    return cache, jnp.where(last[:, None], out.logits, logits)


@functools.partial(jax.jit, static_argnames=("capacity",), donate_argnames=("cache",))
def _start(cache, logits, limit, sb, stop_ids, *, capacity: int) -> LoopState:
    """Sample each row's first token from its prompt's last logits (recorded for rows with a budget, ``limit``
    i32[B] > 0)."""
    tok, sb = sampling.sample_next(logits, sb)  # i32[B]
    b = logits.shape[0]
    state = LoopState(cache=cache, out=jnp.zeros((b, capacity), jnp.int32), last=tok,
                      count=jnp.zeros((b,), jnp.int32), limit=limit, done=limit <= 0, sampling=sb)
    return _record(state, tok, limit > 0, stop_ids)


def _prefill(params, cfg: ModelConfig, cache, prompts, put, *, cache_attention=None):
    """Prefill the prompts in ``batching.prefill_plan``'s chunks (those ``speculative_generate`` uses, so that both
    hold the same K/V bits); returns (cache, f32[B, V] logits at each prompt's last token). ``put`` places a host
    array (on the mesh, when there is one)."""
    tokens, plan = prefill_plan(prompts)
    logits = put(np.zeros((len(prompts), cfg.vocab_size), np.float32))
    for lo, hi, valid, last in plan:
        cache, logits = _prefill_chunk(params, cfg, cache, put(tokens[:, lo:hi]), put(valid), put(last), logits,
                                       cache_attention=cache_attention)
    return cache, logits


@functools.partial(jax.jit, static_argnames=("cfg", "cache_attention"), donate_argnames=("state",))
def _decode_loop(params, cfg: ModelConfig, state: LoopState, stop_ids, *, cache_attention=None) -> LoopState:
    """Decode until every row is done, entirely on device. Finished rows neither write the cache nor advance.
    ``generate`` passes unstacked params; stacked ones are unstacked here, outside the loop: every step then reads
    each layer's weights in place (see ``target.unstack_layers``)."""
    params = target.unstack_layers(params)
    def cond(s: LoopState):
        return ~s.done.all()

    def body(s: LoopState):
        active = ~s.done  # bool[B]
        cache, logits = decode.decode(params, cfg, s.cache, s.last, active, cache_attention=cache_attention)
        tok, sb = sampling.sample_next(logits, s.sampling)
        return _record(dataclasses.replace(s, cache=cache, sampling=sb), tok, active, stop_ids)

    return jax.lax.while_loop(cond, body, state)


def _place_on_mesh(mesh, cache: kv_cache.KVCache):
    """KV pages sharded over kv heads on tp (as the attention weights are); every other input replicated."""
    rep = NamedSharding(mesh, P())
    cache = dataclasses.replace(cache, k=put_kv_pool(cache.k, mesh), v=put_kv_pool(cache.v, mesh),
                                page_table=jax.device_put(cache.page_table, rep),
                                lengths=jax.device_put(cache.lengths, rep))
    return cache, functools.partial(jax.device_put, device=rep)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(params: target.TargetParams, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens,
             temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, stop_token_ids: Sequence[int] | None = None,
             page_size: int | None = None, cache_attention=None, mesh=None,
             rows: Sequence[sampling.SamplingRow] | None = None, capacity: int | None = None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens after each prompt (lists of token ids of any lengths).

    ``max_new_tokens`` and the sampling parameters are scalars or one value per prompt (``seed`` too); temperature 0
    is greedy. A row stops after emitting any of ``stop_token_ids`` (default: the config's eos ids; pass ``()`` to
    never stop early). Returns the generated tokens per prompt, the stop token included (as HF ``generate`` returns
    them). Each row draws from its own PRNG stream, so a row's output does not depend on the other rows in the batch.
    Shapes are bucketed (prompt length to a power of two in chunks of at most 512, budget to 16) so that similar
    calls share one compile.
    With ``mesh`` (a (dp, tp) mesh the params are sharded on, e.g. by ``weights.load_target_params``), the KV cache
    is sharded over kv heads on tp (replicated when they do not divide) and the loop runs under that mesh.
    ``rows``: one ``sampling.SamplingRow`` per prompt (penalties, logit_bias, min_new_tokens...), replacing the
    scalar sampling arguments. ``page_size``: slots per KV page (default: ``kv_cache.default_page_size``).
    ``capacity``: size the cache and output buffers for this many new tokens instead of the call's largest
    ``max_new_tokens`` (``capacity_for``), so that a short call (a warm-up) compiles the programs of a longer one.
    """
    if not prompts:
        return []
    page_size = page_size or kv_cache.default_page_size(cfg.head_dim, cfg.dtype, jax.default_backend())
    # The decode layout, once per call and outside jit, exactly as ``speculative_generate`` takes it (unstacked inside
    # the jitted prefill the layers ran under a scan and unfused, other bits in bf16); pass unstacked params to skip
    # the copy.
    params = target.unstack_layers(params)
    b = len(prompts)
    limit = validate_requests(prompts, cfg.vocab_size, max_new_tokens, temperature, top_k, top_p, min_p)
    if not limit.any():
        return [[] for _ in prompts]

    chunk, n_chunks = prefill_chunks(max(len(p) for p in prompts))
    stop = tuple(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    # Padded with -1 (never a token) to a multiple of 8 so that different stop sets share one compile.
    stop_ids = np.asarray(list(stop) + [-1] * (_round_up(len(stop) + 1, 8) - len(stop)), np.int32)

    capacity = _round_up(capacity_for(limit, capacity), 16)
    # Prompts up to 64 tokens share one cache shape, hence one compile of the decode loop.
    prompt_room = _round_up(max(64, chunk * n_chunks), page_size)
    cache = kv_cache.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, b, prompt_room + capacity,
                                page_size=page_size, dtype=jnp.dtype(cfg.dtype))
    if rows is not None:
        for r in rows:
            r.validate(cfg.vocab_size)
        sb = sampling.SamplingBatch.from_rows(rows, cfg.vocab_size, prompts)
    else:
        sb = sampling.SamplingBatch.make(b, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if mesh is not None:
        cache, put = _place_on_mesh(mesh, cache)
    else:  # the cache and logits threaded through the prefill chunks start as committed as the chunks' outputs
        put = functools.partial(jax.device_put, device=committed_device(params))
        cache = put(cache)
    stop_ids = put(stop_ids)
    with use_mesh(mesh):
        cache, logits = _prefill(params, cfg, cache, prompts, put, cache_attention=cache_attention)
        state = _start(cache, logits, put(np.asarray(limit, np.int32)), put(sb), stop_ids, capacity=capacity)
        if limit.max() > 1:  # else every row is done with its first token: no loop to compile or run
            state = _decode_loop(params, cfg, state, stop_ids, cache_attention=cache_attention)
    out, count = np.asarray(state.out), np.asarray(state.count)
    return [out[i, :count[i]].tolist() for i in range(b)]


# ---- text in, text out ------------------------------------------------------------------------------------------

def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt; with ``chat`` each prompt is one user turn rendered by the chat template."""
    if not chat:
        return [list(tokenizer(p)["input_ids"]) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model has none (drop --chat)")
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def generate_text(model_dir: str, prompts: Sequence[str], chat: bool = False, *, max_new_tokens: int = 128,
                  dtype: str | None = None, model=None, tokenizer=None, **sampling_kw) -> list[str]:
    """Load model and tokenizer from ``model_dir`` (a folder or hub id), generate, and decode to text.

    ``model`` = (cfg, params) and ``tokenizer`` skip loading. ``sampling_kw`` go to ``generate`` (temperature,
    top_k, top_p, min_p, seed, stop_token_ids). Stop tokens default to the eos ids of config.json,
    generation_config.json and the tokenizer. Special tokens (the stop token included) are dropped from the text.
    """
    folder = resolve_model_path(model_dir)
    cfg, params = model if model is not None else load_model(folder, dtype=dtype, layout="decode")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)
    ids = encode_prompts(tokenizer, prompts, chat)
    if sampling_kw.get("stop_token_ids") is None:
        sampling_kw["stop_token_ids"] = stop_token_ids(folder, cfg, tokenizer)
    outs = generate(params, cfg, ids, max_new_tokens=max_new_tokens, **sampling_kw)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in outs]


@dataclasses.dataclass
class GenerateOptions:
    model: str | None = option(None, metavar="PATH", help="folder with config.json, *.safetensors and the tokenizer "
                                                          "(or a hub id when online); default: SmolLM2-135M-Instruct "
                                                          "with the packaged EAGLE3 head")
    prompt: list[str] | None = option(None, action="append", metavar="TEXT",
                                      help="a prompt; repeat for a batch (default: one example prompt)")
    chat: bool = option(False, help="render each prompt as a user turn with the model's chat template")
    max_new_tokens: int = option(128, help="tokens to generate per prompt (default 128)")
    temperature: float = option(0.0, help="0 = greedy (default)")
    top_k: int = option(-1, help="-1 = off (default)")
    top_p: float = option(1.0, help="1 = off (default)")
    min_p: float = option(0.0, help="0 = off (default)")
    seed: int = option(0, help="PRNG seed for sampling (default 0)")
    dtype: str = option("auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="parameter/compute dtype; auto = the checkpoint's torch_dtype (default)")
    speculative_algorithm: str | None = option(None, type=str.upper, choices=("EAGLE3", "EAGLE", "NONE"),
                                               help="speculative decoding with a draft head (default: EAGLE3 for "
                                                    "the default model, none otherwise; NONE forces plain decoding)")
    speculative_draft_model_path: str | None = option(None, metavar="PATH",
                                                      help="the draft head's folder (HF format)")
    speculative_token_map: str | None = option(None, metavar="PATH",
                                               help="FR-Spec hot-token ids for an EAGLE head (.json list, .npy, .pt): "
                                                    "its draft proposes only these tokens")
    speculative_num_steps: int | None = option(None, metavar="N", help="draft depth (default: the head's tuned "
                                                                       "shape (`bench tune`), else 5)")
    speculative_eagle_topk: int | None = option(None, metavar="N", help="branching per draft step (default: the "
                                                                        "head's tuned shape, else 1)")
    speculative_num_draft_tokens: int | None = option(None, metavar="N",
                                                      help="tree tokens verified per step (default: num_steps + 1 "
                                                           "when eagle_topk is 1, else the head's tuned shape, at "
                                                           "most what the tree holds)")
    no_compare: bool = option(False, help="with speculative decoding, skip the timed plain run beside it")
    timing_runs: int = option(3, metavar="N", help="timed runs of each, speculative and plain taking turns; the "
                                                   "figures are their medians (a shared host's speed drifts)")


def _parser() -> argparse.ArgumentParser:
    return options_parser(
        GenerateOptions, "python -m specjax.generate",
        "Generate with a target model, with speculative decoding (EAGLE3 / EAGLE) or plain. With no --model: "
        "SmolLM2-135M-Instruct (fetched on first use) with the EAGLE3 head shipped in the package, at its tuned "
        "tree shape, timed beside plain decoding of the same prompt.",
        epilog="examples:\n"
               "  python -m specjax.generate --chat --prompt 'Explain what a binary search does.'\n"
               "  python -m specjax.generate --model ./SmolLM2-135M-Instruct --chat --prompt 'What is JAX?'\n"
               "  python -m specjax.generate --model M --speculative-algorithm EAGLE3 "
               "--speculative-draft-model-path HEAD --chat --prompt 'Hi'")


DEFAULT_TREE = (5, 1, 6)  # a chain: the shape of a head without a `bench tune` table
TREE_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")


def _tuned_shape(args, head: str, say: bool) -> tuple[int, int, int]:
    """The head's tuned tree shape at this batch size (DEFAULT_TREE without a tune table); ``say``: print a note
    when the table measured plain decoding faster (the tuned tree runs anyway)."""
    table = load_tune(head, dtype=args.dtype)
    if not table:
        return DEFAULT_TREE
    b = len(args.prompt or [1])
    tuned = shape_for(table, b)
    elsewhere = tuned_elsewhere(head, args.dtype)
    if say and elsewhere is not None:
        print(f"note: the head's tree table was measured on {elsewhere[1]}; on this machine the smallest tree that "
              f"paid there runs (`python -m specjax.bench tune --draft {head}` measures this machine's)",
              file=sys.stderr)
    if tuned is None:  # plain was measured faster: still show the best speculative shape, and say so
        tuned = shape_for(load_tune(head, "best_speculative", args.dtype), b)
        if say:
            print(f"note: `bench tune` measured plain decoding faster than every tree shape for this head at batch "
                  f"{b} ({table_path(head, args.dtype)}); running its fastest shape anyway", file=sys.stderr)
    return tuned


def _tree_shape(args, head: str) -> tuple[int, int, int]:
    """The tree flags given, the others filled from the head's tuned shape so that the tree is one that runs (a
    chain's num_draft_tokens is num_steps + 1): a flag the user never set is never the one blamed."""
    steps, topk, draft = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    for flag, value, least in zip(TREE_FLAGS, (steps, topk, draft), (1, 1, 2)):  # before any is derived from it
        if value is not None and value < least:
            why = " (the root + at least one draft token)" if least == 2 else ""
            raise ValueError(f"{flag} must be >= {least}{why}, got {value}")
    if None in (steps, topk, draft):
        base = _tuned_shape(args, head, say=(steps, topk, draft) == (None, None, None))
        topk = base[1] if topk is None else topk
        if steps is None:
            steps = draft - 1 if draft is not None and topk == 1 else base[0]
        if draft is None:
            draft = steps + 1 if topk == 1 else min(base[2], 1 + num_candidates(steps, topk))
    validate_tree(steps, topk, draft)
    return steps, topk, draft


def _resolve_pair(args) -> tuple[str, str | None, str | None, tuple[int, int, int] | None]:
    """(model folder, algorithm or None, head folder, tree shape) from the flags and the defaults."""
    model, algo, head = args.model, args.speculative_algorithm, args.speculative_draft_model_path
    if model is None:
        model = default_smollm2_path()
        if not os.path.isdir(model):
            print(f"first use: fetching and converting SmolLM2-135M-Instruct into {model}", file=sys.stderr)
            fetch_smollm2(model)
        if algo is None and head is None and default_head_available():
            algo, head = DEFAULT_ALGORITHM, DEFAULT_HEAD
    if ignored_map := check_token_map_use(algo, args.speculative_token_map):
        print(f"note: {ignored_map}", file=sys.stderr)
    given = [f for f, v in zip(TREE_FLAGS, (args.speculative_num_steps, args.speculative_eagle_topk,
                                             args.speculative_num_draft_tokens)) if v is not None]
    if given and head is None and algo in (None, "NONE"):  # plain decoding would ignore them
        raise ValueError(f"tree flags ({', '.join(given)}) need --speculative-algorithm and "
                         f"--speculative-draft-model-path")
    if algo == "NONE":
        if head is not None:
            raise ValueError("--speculative-algorithm NONE decodes plainly: drop --speculative-draft-model-path, or "
                             "name the head's algorithm (EAGLE3 or EAGLE)")
        return model, None, None, None
    if algo is None and head is not None:
        raise ValueError("--speculative-draft-model-path needs --speculative-algorithm EAGLE3 (or EAGLE)")
    if algo is not None and head is None:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path PATH")
    if algo is None:
        return model, None, None, None
    return model, algo, head, _tree_shape(args, head)


def _timed(fn, max_new_tokens: int):
    """fn(max_new_tokens=...) timed, after a warm-up call (``warmup_budget``) that compiles (or loads) the very
    programs the timed call runs. Returns (result, seconds)."""
    fn(**warmup_budget(max_new_tokens))
    t0 = time.perf_counter()
    out = fn(max_new_tokens=max_new_tokens)
    return out, time.perf_counter() - t0


def speculative_demo(args, prompts: list[str]) -> int:
    """EAGLE3/EAGLE generation of ``prompts``, timed beside plain decoding of the same prompts; prints both."""
    model, algo, head, shape = _resolve_pair(args)
    folder = resolve_model_path(model)
    cfg, params = load_model(folder, dtype=None if args.dtype == "auto" else args.dtype, layout="decode")
    tok = load_tokenizer(folder)
    ids = encode_prompts(tok, prompts, args.chat)
    cfg.check_context(max(map(len, ids)), args.max_new_tokens, "shorten the prompt or lower --max-new-tokens")
    kw = dict(temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop_token_ids=stop_token_ids(folder, cfg, tok))
    if algo is None:
        outs = generate(params, cfg, ids, max_new_tokens=args.max_new_tokens, **kw)
        _print_texts(prompts, [tok.decode(o, skip_special_tokens=True) for o in outs])
        return 0
    dcfg, dparams, vocab = load_draft(head, algo, cfg, token_map=args.speculative_token_map)
    draft = make_draft(algo, dcfg, dparams, params, vocab)
    print(f"{algo} head {head}, tree (steps {shape[0]}, topk {shape[1]}, draft tokens {shape[2]}); compiling ...",
          file=sys.stderr, flush=True)
    spec_fn = lambda **budget: speculative_generate(  # noqa: E731
        params, cfg, draft, ids, algorithm=algo, num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2], **kw,
        **budget)
    (outs, stats), t_first = _timed(spec_fn, args.max_new_tokens)
    _print_texts(prompts, [tok.decode(o, skip_special_tokens=True) for o in outs])
    n = sum(len(o) for o in outs)
    accept = (f"accept length {stats['tau']:.2f} tokens per verify step" if sum(stats["verify_steps"]) else
              "no verify step (every answer ended with its first token)")
    if args.no_compare:
        print(f"\n{algo}: {n} tokens in {t_first:.2f} s = {n / t_first:.1f} tok/s, {accept}")
        return 0
    plain, t_spec, t_plain = _interleaved(spec_fn, lambda **budget: generate(params, cfg, ids, **kw, **budget),
                                          args.max_new_tokens, args.timing_runs, t_first)
    m = sum(len(o) for o in plain)
    same = ("identical to" if plain == outs else "differs (sampling) from" if args.temperature > 0 else
            "DIFFERS from")
    runs = f" (medians of {args.timing_runs} runs each, taking turns)" if args.timing_runs > 1 else ""
    print(f"\n{algo}: {n} tokens in {t_spec:.2f} s = {n / t_spec:.1f} tok/s, {accept}")
    speedup = (n / t_spec) / (m / t_plain)
    print(f"plain: {m} tokens in {t_plain:.2f} s = {m / t_plain:.1f} tok/s; speedup {speedup:.2f}x;"
          f" output {same} plain decoding{runs}")
    return 0


def _interleaved(spec_fn, plain_fn, max_new_tokens: int, runs: int, t_spec_first: float):
    """The plain run's result and the median seconds of ``runs`` speculative runs (the first already timed:
    ``t_spec_first``) and ``runs`` plain ones, taking turns (plain, speculative, plain, ...), so that a host whose
    speed drifts slows both alike. Returns (plain result, spec seconds, plain seconds)."""
    plain, t_plain = _timed(plain_fn, max_new_tokens)
    spec_times, plain_times = [t_spec_first], [t_plain]
    for _ in range(runs - 1):
        for fn, times in ((spec_fn, spec_times), (plain_fn, plain_times)):
            t0 = time.perf_counter()
            fn(max_new_tokens=max_new_tokens)
            times.append(time.perf_counter() - t0)
    return plain, statistics.median(spec_times), statistics.median(plain_times)


def _print_texts(prompts, texts) -> None:
    for i, (p, t) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"--- [{i}] {p}")
        print(t)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_into(GenerateOptions, _parser(), argv)
    enable_compilation_cache()
    prompts = args.prompt or ["The capital of France is"]
    try:
        sampling.validate(args.temperature, args.top_k, args.top_p, args.min_p)
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if args.timing_runs < 1:
            raise ValueError("--timing-runs must be >= 1")
        return speculative_demo(args, prompts)
    except (WeightsError, ConfigError, SafetensorsError, FetchError, TuneError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
