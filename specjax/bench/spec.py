"""Plain vs speculative decoding on the same prompts, in one process.

    python -m specjax.bench spec --model PATH (--draft PATH | --random-draft) [--algorithm EAGLE3|EAGLE]
        [--num-steps 3 --topk 1 --num-draft-tokens 4] [--prompts mtbench|FILE] [--num-prompts 8]
        [--max-new-tokens 64] [--speculative-token-map FILE] [--attention-impl auto|xla|pallas] [--json OUT]
        [--profile-dir DIR]
        [--vs-llama-server BIN --draft-gguf HEAD.gguf [--gguf TARGET.gguf] [--llama-draft-n-max 3 5 7]]
    python -m specjax.bench spec --verify-sweep 1,8,16,32,64 [--model PATH | --random-llama-8b [--layers N]]
        [--context 512] [--batch 1]
    python -m specjax.bench spec --runner-steps 1,16 --draft PATH [--num-steps 1 --topk 2 --num-draft-tokens 3]
        [--context 200]

Main mode (batch 1, prompts one after another, as SGLang's batch-1 MT-bench figures): every prompt is generated
once untimed (compiles every shape) and once timed, by ``specjax.generate.generate`` (plain, one jitted while_loop)
and by ``speculative_generate`` (one jitted while_loop of draft-verify-commit steps). Prints tokens/s of both (all
generated tokens / wall time incl. prefill), the speedup, tau (= completion tokens / verify steps, SGLang's
spec_accept_length) and per-phase step times: draft (tree growth + selection), verify (one target forward over the
M tree tokens), accept, commit (KV write + draft extend), each jitted separately and timed on the same state, next to
the fused step and a plain decode step. Prompts: MT-bench first turns, rendered with the chat template.
``--profile-dir DIR`` also traces fused and plain steps with the JAX profiler and prints where each one's time goes:
per kernel on a GPU or TPU, per XLA operation (custom-call target or opcode, and result shape) on a CPU.

``--vs-llama-server`` adds llama.cpp on the same prompts and weights: its ``llama-server`` plain, and with the same
head converted to GGUF as an EAGLE3 draft (``--spec-type draft-eagle3``, a chain of up to ``n_max`` tokens, one
server per setting), greedy, all cores for both; each prompt once untimed, then timed, wall time per request incl.
prefill. tau for llama.cpp = generated / (generated - accepted draft tokens), one target step per emitted run.

``--verify-sweep`` times the target forward over M tree tokens (ancestor mask, logits for all M, aux features) at
a ``--context``-token prefix against a plain decode step: what verifying a wider tree costs.

``--runner-steps`` times what the server runs, per batch size with every slot holding a ``--context``-token prompt:
``PlainRunner.step`` against ``SpecRunner.step`` as a target-only step and with the tree, each on a state of its own
(so the target-only rows stay at the plain rows' context), in blocks of steps back to back with the kinds' order
alternating, median over at least ``--phase-repeats`` x 4 steps (the KV pools donated, as in the server).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from specjax.bench.common import TargetRunOptions, print_table, read_prompt_file, report
from specjax.bench.llamacpp import LlamaServer
from specjax.bench.profile import enable_cpu_op_events, print_summary, summarize_program, trace_call
from specjax.cli import option, parse_options
from specjax.speculative.tree import validate as validate_tree


def _median(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_steps(step, state, repeats: int) -> float:
    """``_median`` of ``state = step(state)`` on a copy of ``state`` (``step`` donates it)."""
    import jax
    import jax.numpy as jnp
    box = [jax.tree.map(jnp.copy, state)]

    def one():
        box[0] = step(box[0])
        return box[0]

    return _median(one, repeats)


def prompt_texts(spec: str, n: int) -> tuple[list[str], str, bool]:
    """The first ``n`` prompt texts of ``spec`` ('mtbench' or a file), a note on where they came from, and whether
    they are chat turns."""
    if spec == "mtbench":
        path, note = None, ""
        try:
            from specjax.hub import fetch_mtbench
            path = fetch_mtbench()
            note = f"MT-bench first turns ({path})"
        except Exception as e:  # noqa: BLE001 - fall back to the shared copy when the fetch is impossible offline
            shared = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                                  "mt_bench_question.jsonl")
            if os.path.exists(shared):
                path = os.path.abspath(shared)
                note = f"MT-bench first turns ({path}; fetch_mtbench failed: {type(e).__name__})"
        if path is None:
            raise SystemExit("MT-bench questions unavailable: run `python -m specjax.convert fetch-mtbench`")
        return read_prompt_file(path, n), note, True
    if os.path.exists(spec):
        texts = read_prompt_file(spec, n)
        return texts, f"{spec} (first {len(texts)})", False
    raise SystemExit(f"--prompts: expected 'mtbench', 'random' or a file, got {spec!r}")


def load_prompts(spec: str, tokenizer, n: int, vocab_size: int,
                 texts: tuple[list[str], str, bool] | None = None) -> tuple[list[list[int]], str]:
    """Token ids of the first ``n`` prompts and a note on where they came from; ``texts``: what
    ``prompt_texts(spec, n)`` gave, when the caller read them before loading the model."""
    import numpy as np
    if spec == "random":
        rng = np.random.default_rng(0)
        return rng.integers(100, vocab_size, size=(n, 64)).tolist(), "random 64-token prompts"
    texts, note, chat = texts or prompt_texts(spec, n)
    if tokenizer is None:
        raise SystemExit("text prompts need a tokenizer in the model folder; use --prompts random")
    from specjax.generate import encode_prompts
    chat = chat and bool(getattr(tokenizer, "chat_template", None))
    return encode_prompts(tokenizer, texts, chat), note + (" (chat template)" if chat else "")


def random_draft(algorithm: str, tcfg, seed: int = 1):
    import jax

    from specjax.models import eagle, eagle3
    if algorithm == "EAGLE3":
        cfg = eagle3.Eagle3Config.from_target(tcfg)
        return cfg, eagle3.init_params(cfg, jax.random.PRNGKey(seed)), None
    cfg = eagle.EagleConfig.from_target(tcfg)
    return cfg, eagle.init_params(cfg, jax.random.PRNGKey(seed)), None


def load_target(args):
    from specjax.models import target
    if args.random_llama_8b:
        from specjax.bench.decode import random_llama_config, random_params
        cfg = random_llama_config(args.layers, args.dtype or "bfloat16")
        note = f"random Llama-3.1-8B-shaped ({cfg.num_layers} layers, {cfg.dtype})"
        return cfg, target.unstack_layers(random_params(cfg)), None, note
    from specjax.weights import load_model, resolve_model_path
    path = args.model
    if path is None:
        from specjax.hub import default_smollm2_path
        path = default_smollm2_path()
        if not os.path.isdir(path):
            raise SystemExit(f"no --model and no SmolLM2 at {path}: `python -m specjax.convert fetch-smollm2`")
    folder = resolve_model_path(path)
    cfg, params = load_model(folder, dtype=args.dtype, layout="decode")  # as the server and SpecRunner hold it
    tok = None
    try:
        from specjax.generate import load_tokenizer
        tok = load_tokenizer(folder)
    except Exception:  # noqa: BLE001 - a model folder without a tokenizer still benchmarks with random prompts
        pass
    return cfg, params, tok, f"{folder} ({cfg.num_layers} layers, {cfg.dtype})"


def load_head(args, tcfg):
    """The head of ``--draft`` (or ``--random-draft``): ((cfg, params, vocab map or token map), description)."""
    from specjax import head_weights
    alg = args.algorithm.upper()
    if args.random_draft or not args.draft:
        if not args.random_draft:
            raise SystemExit("pass --draft PATH or --random-draft")
        return random_draft(alg, tcfg), f"random {alg} head"
    return (head_weights.load_draft(args.draft, alg, tcfg, token_map=args.speculative_token_map),
            f"{args.draft} ({alg})")


def _whole_steps(tparams, tcfg, draft, scfg, state, active) -> dict:
    """The three whole steps as the server and the generate loops run them (each donates its state, so its K/V writes
    land in place): name -> (``step(s) -> s``, the state it starts from, ``lower()``: its lowered program)."""
    import jax

    from specjax import plain_step as decode
    from specjax.speculative import spec_step as step_lib

    # Params travel as arguments (not closed over) so that XLA does not constant-fold the weights.
    donated = dict(static_argnames=("tcfg", "scfg"), donate_argnames=("state",))
    f_step = jax.jit(step_lib.spec_step, **donated)
    f_target = jax.jit(step_lib.target_step, **donated)
    f_plain = jax.jit(decode.decode, static_argnames=("cfg", "cache_attention"), donate_argnames=("cache",))
    spec_args = lambda s: (tparams, tcfg, draft, scfg, s, active)
    plain_args = lambda c: (tparams, tcfg, c, state.last_token, active)
    plain_kw = dict(cache_attention=scfg.cache_attention)
    return {"fused_step": (lambda s: f_step(*spec_args(s))[0], state, lambda: f_step.lower(*spec_args(state))),
            "target_only_step": (lambda s: f_target(*spec_args(s))[0], state,
                                 lambda: f_target.lower(*spec_args(state))),
            "plain_decode_step": (lambda c: f_plain(*plain_args(c), **plain_kw)[0], state.cache,
                                  lambda: f_plain.lower(*plain_args(state.cache), **plain_kw))}


def phase_times(tparams, tcfg, draft, scfg, prompt, repeats: int, profile_dir: str | None = None
                ) -> tuple[dict, dict]:
    """Per-phase times (seconds) of one speculative step on the state after ``prompt``'s prefill, of a target-only
    step (what the server runs where the tree does not pay) and of a plain decode step; with ``profile_dir``, also
    where the time of a fused and of a plain step goes (``profile_steps``), else ``{}``.

    The phases are timed on the same state, undonated (each call writes a fresh copy of its outputs). The three
    whole steps run as the server and the generate loops run them: each on its own copy of the state, donated and
    advanced step after step, so their K/V writes land in place and the ratio of a step to a plain one is the
    served one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.speculative import spec_step as step_lib, verify as verify_lib

    n = len(prompt)
    page = 16
    room = (repeats + 2) * scfg.tokens_per_step + 8  # the whole steps advance the state every call
    state = step_lib.init_state(tcfg, draft, scfg, 1, -(-(n + room) // page) * page, page_size=page)
    t = -(-n // page) * page
    toks = np.zeros((1, t), np.int32)
    toks[0, :n] = prompt
    nxt = np.zeros_like(toks)
    nxt[0, :n - 1] = prompt[1:]
    valid = np.arange(t)[None] < n
    state, _ = jax.jit(step_lib.prefill, static_argnames=("tcfg", "scfg"))(
        tparams, tcfg, draft, scfg.for_prefill(), state, jnp.asarray(toks), jnp.asarray(nxt), jnp.asarray(valid),
        jnp.ones((1,), bool))
    state = jax.jit(step_lib.refresh_root, static_argnames=("scfg",))(tparams, draft, scfg, state)
    active = jnp.ones((1,), bool)
    f_draft = jax.jit(step_lib.draft_phase, static_argnames=("scfg",))
    f_verify = jax.jit(step_lib.verify_phase, static_argnames=("tcfg", "scfg"))
    f_accept = jax.jit(verify_lib.accept, static_argnames=("num_steps", "may_sample"))
    f_commit = jax.jit(step_lib.commit_phase, static_argnames=("scfg",))
    tree = f_draft(tparams, draft, scfg, state)
    out = f_verify(tparams, tcfg, draft, scfg, state, tree, active)
    acc, sb = f_accept(tree, out.logits, state.sampling, num_steps=scfg.num_steps, may_sample=False)
    whole = _whole_steps(tparams, tcfg, draft, scfg, state, active)
    times = dict(draft=_median(lambda: f_draft(tparams, draft, scfg, state), repeats),
                 verify=_median(lambda: f_verify(tparams, tcfg, draft, scfg, state, tree, active), repeats),
                 accept=_median(lambda: f_accept(tree, out.logits, state.sampling, num_steps=scfg.num_steps,
                                                 may_sample=False), repeats),
                 commit=_median(lambda: f_commit(tparams, draft, scfg, state, acc, out, active, sb), repeats),
                 **{name: _median_steps(step, s0, repeats) for name, (step, s0, _) in whole.items()})
    return times, (profile_steps(whole, repeats, profile_dir) if profile_dir else {})


def profile_steps(whole: dict, repeats: int, log_dir: str, rounds: int = 2) -> dict:
    """Where the time of a fused step and of a plain decode step goes (``_whole_steps``): ``rounds`` rounds, each
    tracing ``repeats`` steps of one and then of the other under ``jax.profiler`` (each from its own copy of the
    state), so that a shared host's drift falls on both alike; ``bench.profile.summarize_program`` over each one's
    traces: by kernel on a GPU or TPU, by XLA:CPU operation on a CPU (``enable_cpu_op_events``)."""
    import jax
    import jax.numpy as jnp
    names = ("fused_step", "plain_decode_step")
    paths: dict[str, list[str]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            step, s0, _ = whole[name]
            box = [jax.block_until_ready(step(jax.tree.map(jnp.copy, s0)))]  # compiled, warm, done before the trace

            def run(step=step, box=box):
                for _ in range(repeats):
                    box[0] = step(box[0])
                return box[0]

            paths[name].append(trace_call(run, os.path.join(log_dir, name, f"trace{r + 1}")))  # a folder each
    out = {}
    for name in names:
        summary = {"path": os.path.join(log_dir, name), "rounds": rounds}
        try:
            out[name] = summarize_program(paths[name], rounds * repeats, whole[name][2]().compile().as_text()) \
                | summary
        except ValueError as e:  # a CPU program compiled without ``enable_cpu_op_events``: no operation events
            out[name] = summary | {"error": str(e)}
    return out


def bench_spec(args) -> dict:
    from specjax.batching import warmup_budget
    from specjax.generate import generate
    from specjax.kernels.tree_attention import make_cache_attention
    from specjax.speculative import draft as draft_lib, spec_step as step_lib
    from specjax.speculative.spec_generate import speculative_generate

    texts = None if args.prompts == "random" else prompt_texts(args.prompts, args.num_prompts)  # before the model
    tcfg, tparams, tokenizer, model_note = load_target(args)
    alg = args.algorithm.upper()
    (dcfg, dparams, vocab), draft_note = load_head(args, tcfg)
    draft = draft_lib.make_draft(alg, dcfg, dparams, tparams, vocab)
    prompts, prompt_note = load_prompts(args.prompts, tokenizer, args.num_prompts, tcfg.vocab_size, texts)
    stop = tuple(tcfg.eos_token_ids)
    conf = dict(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    budget = dict(max_new_tokens=args.max_new_tokens)

    def run_plain(p, budget=budget):
        return generate(tparams, tcfg, [p], stop_token_ids=stop, **budget)[0]

    def run_spec(p, budget=budget):
        return speculative_generate(tparams, tcfg, draft, [p], algorithm=alg, attention_impl=args.attention_impl,
                                    stop_token_ids=stop, **conf, **budget)

    print(f"warming up (compiling every prompt shape) on {len(prompts)} prompts ...", file=sys.stderr, flush=True)
    for p in prompts:
        run_plain(p, warmup_budget(args.max_new_tokens))
        run_spec(p, warmup_budget(args.max_new_tokens))
    plain_out, spec_res, t_plain, t_spec = [], [], 0.0, 0.0
    for i, p in enumerate(prompts):  # in turns, the order alternating, so the host's drift falls on both sides
        for kind in ("plain", "spec")[::1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            if kind == "plain":
                plain_out.append(run_plain(p))
                t_plain += time.perf_counter() - t0
            else:
                spec_res.append(run_spec(p))
                t_spec += time.perf_counter() - t0
    spec_out = [r[0][0] for r in spec_res]
    n_plain = sum(len(o) for o in plain_out)
    n_spec = sum(len(o) for o in spec_out)
    steps = sum(r[1]["verify_steps"][0] for r in spec_res)
    same = sum(a == b for a, b in zip(plain_out, spec_out))
    scfg = step_lib.SpecConfig(args.num_steps, args.topk, args.num_draft_tokens,
                               make_cache_attention(args.attention_impl), sampling=False)
    phases, profiles = phase_times(tparams, tcfg, draft, scfg, prompts[0], args.phase_repeats, args.profile_dir)
    llama = llama_server_rows(args, prompts, plain_out, stop) if args.vs_llama_server else []
    return dict(llama_server=llama, model=model_note, draft=draft_note, prompts=prompt_note, algorithm=alg, **conf,
                max_new_tokens=args.max_new_tokens, plain_tokens=n_plain, spec_tokens=n_spec,
                plain_tok_s=n_plain / t_plain, spec_tok_s=n_spec / t_spec,
                speedup=(n_spec / t_spec) / (n_plain / t_plain), tau=n_spec / max(steps, 1), verify_steps=steps,
                identical_outputs=f"{same}/{len(prompts)}", phases_ms={k: v * 1e3 for k, v in phases.items()},
                profiles=profiles)


def _trim(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    """The tokens up to (not including) the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return list(tokens[:i])
    return list(tokens)


def llama_server_rows(args, prompts, plain_out, stop) -> list[dict]:
    """llama.cpp's plain and EAGLE3 decoding of the same prompts through llama-server, one server per setting."""
    if not args.draft_gguf:
        raise SystemExit("error: --vs-llama-server needs --draft-gguf HEAD.gguf (the head converted by llama.cpp's "
                         "convert_hf_to_gguf.py HEAD --target-model-dir TARGET, see docs/04-export.md)")
    gguf = args.gguf
    if gguf is None:
        if args.model is not None:
            raise SystemExit("error: --vs-llama-server with --model needs --gguf PATH (a GGUF of the same weights)")
        from specjax.hub import fetch_smollm2_gguf
        gguf = fetch_smollm2_gguf(args.dtype or "float32")
    threads = os.cpu_count() or 1
    settings = [("llama.cpp plain", None, 0)] + [(f"llama.cpp EAGLE3 n_max={n}", args.draft_gguf, n)
                                                  for n in args.llama_draft_n_max]
    rows = []
    for name, draft_gguf, n_max in settings:
        print(f"llama-server: {name} ...", file=sys.stderr, flush=True)
        server = LlamaServer(args.vs_llama_server, gguf, threads, draft_gguf, n_max=max(n_max, 1),
                             p_min=args.llama_draft_p_min)
        try:
            for p in prompts:
                server.complete(p, args.max_new_tokens)
            t0 = time.perf_counter()
            res = [server.complete(p, args.max_new_tokens) for p in prompts]
            dt = time.perf_counter() - t0
        finally:
            server.close()
        outs = [_trim(toks, stop) for toks, _ in res]
        n_tok = sum(len(toks) for toks, _ in res)
        accepted = sum(int(t.get("draft_n_accepted", 0)) for _, t in res)
        drafted = sum(int(t.get("draft_n", 0)) for _, t in res)
        same = sum(a == _trim(b, stop) for a, b in zip(outs, plain_out))
        # tau as specjax's: generated tokens / verify steps; each request's first token comes from its prompt's
        # forward, every later step gives one token plus the drafts it accepted
        steps = n_tok - len(res) - accepted
        rows.append(dict(name=name, tokens=n_tok, tok_s=n_tok / dt, tau=n_tok / max(steps, 1) if drafted else 1.0,
                         drafted=drafted, accepted=accepted, same_as_specjax_plain=f"{same}/{len(prompts)}"))
    return rows


def print_spec_table(r: dict) -> None:
    print(f"model: {r['model']}\ndraft: {r['draft']}\nprompts: {r['prompts']}, max_new_tokens {r['max_new_tokens']}, "
          f"batch 1, greedy")
    print(f"tree: num_steps={r['num_steps']} topk={r['topk']} num_draft_tokens={r['num_draft_tokens']}\n")
    print_table(["decoding", "tokens", "tok/s", "speedup", "tau"],
                [["plain", r["plain_tokens"], f"{r['plain_tok_s']:.1f}", "1.00", "1.00"],
                 [r["algorithm"], r["spec_tokens"], f"{r['spec_tok_s']:.1f}", f"{r['speedup']:.2f}",
                  f"{r['tau']:.2f}"]])
    print(f"\noutputs identical to plain greedy: {r['identical_outputs']}\n")
    if r.get("llama_server"):
        print(f"llama.cpp (llama-server, {os.cpu_count()} threads), same prompts and weights:\n")
        print_table(["decoding", "tokens", "tok/s", "vs specjax plain", "vs specjax " + r["algorithm"], "tau",
                     "drafted / accepted", "tokens == specjax plain"],
                    [[x["name"], x["tokens"], f"{x['tok_s']:.1f}", f"{x['tok_s'] / r['plain_tok_s']:.2f}",
                      f"{x['tok_s'] / r['spec_tok_s']:.2f}", f"{x['tau']:.2f}", f"{x['drafted']} / {x['accepted']}",
                      x["same_as_specjax_plain"]] for x in r["llama_server"]])
        print()
    print_table(["phase (one step, batch 1)", "ms"], [[k, f"{v:.2f}"] for k, v in r["phases_ms"].items()])
    for name, summary in r.get("profiles", {}).items():
        title = f"{name.replace('_', ' ')} ({summary['path']}, {summary['rounds']} traces in turns with the other step)"
        if "error" in summary:
            print(f"\n{title}: {summary['error']}")
        else:
            print_summary(summary, unit="step", title=title)


def bench_verify_sweep(args) -> dict:
    import jax
    import jax.numpy as jnp

    from specjax import kv_cache, layers, plain_step as decode
    from specjax.config import default_aux_layer_ids
    from specjax.kernels.tree_attention import make_cache_attention
    from specjax.models import target

    tcfg, tparams, _, model_note = load_target(args)
    ms = positive_ints(args.verify_sweep, "--verify-sweep")
    b, ctx, page = args.batch, args.context, 16
    max_len = -(-(ctx + max(ms) + 1) // page) * page
    cache = kv_cache.init_cache(tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim, b, max_len, page_size=page,
                                dtype=jnp.dtype(tcfg.dtype))
    cache = kv_cache.KVCache(k=cache.k, v=cache.v, page_table=cache.page_table,
                             lengths=jnp.full((b,), ctx, jnp.int32))
    hook = make_cache_attention(args.attention_impl)
    active = jnp.ones((b,), bool)
    # Both sides as served: the pool donated and written in place (an undonated call copies both pools every time),
    # the verify writing its root's K/V (``spec_step.verify_phase`` on a tree), the context held at ``ctx``.

    def plain_step(state):
        c, _ = state
        new, logits = decode.decode(tparams, tcfg, c, jnp.zeros((b,), jnp.int32), active, cache_attention=hook)
        return dataclasses.replace(new, lengths=c.lengths), logits

    def first(step):  # the state with the outputs' structure, so the warm-up call compiles what the timed ones run
        return cache, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(step, (cache, None))[1])

    t_plain = _median_steps(jax.jit(plain_step, donate_argnums=(0,)), first(plain_step), args.phase_repeats)
    aux = default_aux_layer_ids(tcfg.num_layers)
    rows = []
    for m in ms:
        def verify(state, m=m):
            toks = jnp.zeros((b, m), jnp.int32)
            pos = ctx + jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
            out = target.forward(tparams, tcfg, toks, pos, cache=state[0], mask=layers.causal_mask(
                jnp.ones((b, m), bool)), aux_layers=aux, return_kv=True, cache_attention=hook,
                write_valid=jnp.broadcast_to(jnp.arange(m) == 0, (b, m)))
            return out.cache, (out.logits, out.aux, out.k_new, out.v_new)

        t = _median_steps(jax.jit(verify, donate_argnums=(0,)), first(verify), args.phase_repeats)
        rows.append(dict(m=m, ms=t * 1e3, vs_decode=t / t_plain))
    return dict(model=model_note, context=ctx, batch=b, plain_decode_ms=t_plain * 1e3, rows=rows)


def runner_step_times(tcfg, tparams, algorithm: str, head, shape, batch_sizes, context: int, repeats: int,
                      seed: int = 0, block: int = 5) -> list[dict]:
    """Median ms of a PlainRunner step, a SpecRunner target-only step and a SpecRunner ``shape`` tree step, per batch
    size, every slot running a ``context``-token random prompt; head = (cfg, params, vocab map or token map).

    Each kind runs in blocks of ``block`` steps back to back, as a server runs them, the kinds' order alternating
    from round to round; the first step of a block (the one after another runner's step, which pays for the switch
    between the two runners' pools: up to 1.13x at batch 16 on a Zen 5 VM) is not counted."""
    import jax
    import numpy as np

    from specjax.serve.runners.plain import PlainRunner
    from specjax.serve.runners.spec import SpecRunner

    page = 16
    rounds = -(-4 * repeats // (block - 1)) + 1  # the first round compiles; a step adds up to num_steps + 1 tokens
    pps = -(-(context + rounds * block * (shape[0] + 1) + shape[0] + 1) // page)
    rng = np.random.default_rng(seed)
    rows = []
    for b in batch_sizes:
        kw = dict(max_batch=b, pages_per_seq=pps, page_size=page, num_pages=b * pps + 1)
        spec = lambda: SpecRunner(tcfg, tparams, algorithm, *head, num_steps=shape[0], topk=shape[1],
                                  num_draft_tokens=shape[2], **kw)
        # one runner and state per kind: the target-only rows stay at the plain rows' context (tree steps advance
        # theirs by up to num_steps + 1 tokens, and attention's cost with it)
        runners = {"plain": (PlainRunner(tcfg, tparams, **kw), {}), "target_only": (spec(), {"tree": None}),
                   "tree": (spec(), {"tree": shape})}
        prompts = [rng.integers(0, tcfg.vocab_size, context) for _ in range(b)]
        states = {}
        for k, (r, _) in runners.items():
            st = r.init_state()
            for i, p in enumerate(prompts):
                st, _ = r.prefill(st, i, p, np.arange(1 + i * pps, 1 + (i + 1) * pps), {"temperature": 0.0})
            states[k] = st
        active = np.ones((b,), bool)
        times = {k: [] for k in runners}
        for it in range(rounds):
            for k in (list(runners) if it % 2 == 0 else list(runners)[::-1]):
                r, step_kw = runners[k]
                for j in range(block):
                    t = time.perf_counter()
                    states[k] = r.step(states[k], active, **step_kw)[0]
                    jax.block_until_ready(states[k])
                    if it and j:
                        times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append(dict(batch=b, plain_ms=med["plain"], target_only_ms=med["target_only"], tree_ms=med["tree"],
                         target_only_vs_plain=med["target_only"] / med["plain"],
                         tree_vs_plain=med["tree"] / med["plain"]))
    return rows


def bench_runner_steps(args) -> dict:
    tcfg, tparams, _, model_note = load_target(args)
    alg = args.algorithm.upper()
    head, draft_note = load_head(args, tcfg)
    shape = (args.num_steps, args.topk, args.num_draft_tokens)
    sizes = positive_ints(args.runner_steps, "--runner-steps")
    rows = runner_step_times(tcfg, tparams, alg, head, shape, sizes, args.context, args.phase_repeats)
    return dict(model=model_note, draft=draft_note, tree=list(shape), context=args.context, rows=rows)


def print_runner_table(r: dict) -> None:
    print(f"model: {r['model']}\ndraft: {r['draft']}\nevery slot at a {r['context']}-token prompt; tree "
          f"{tuple(r['tree'])}\n")
    print_table(["batch", "plain step ms", "target-only step ms", "x plain", "tree step ms", "x plain"],
                [[x["batch"], f"{x['plain_ms']:.2f}", f"{x['target_only_ms']:.2f}", f"{x['target_only_vs_plain']:.3f}",
                  f"{x['tree_ms']:.2f}", f"{x['tree_vs_plain']:.3f}"] for x in r["rows"]])


def print_sweep_table(r: dict) -> None:
    print(f"model: {r['model']}\nprefix {r['context']} tokens, batch {r['batch']}; plain decode step "
          f"{r['plain_decode_ms']:.2f} ms\n")
    print_table(["tree tokens M", "verify forward ms", "x plain decode step"],
                [[x["m"], f"{x['ms']:.2f}", f"{x['vs_decode']:.2f}"] for x in r["rows"]])


@dataclasses.dataclass
class SpecOptions(TargetRunOptions):
    model: str | None = option(None, help="HF model folder (default: the SmolLM2 cache of `convert fetch-smollm2`)")
    draft: str | None = option(None, help="draft head folder (HF format)")
    random_draft: bool = option(False, help="a random head shaped like one target layer")
    algorithm: str = option("EAGLE3", choices=["EAGLE3", "EAGLE", "eagle3", "eagle"], help="draft head kind")
    speculative_token_map: str | None = option(None, help="FR-Spec hot-token list for EAGLE heads")
    num_steps: int = option(3, help="tree depth (--speculative-num-steps)")
    topk: int = option(1, help="branching (--speculative-eagle-topk)")
    num_draft_tokens: int = option(4, help="tree size incl. the root (--speculative-num-draft-tokens)")
    prompts: str = option("mtbench", help="mtbench (default), random, or a .jsonl/.txt file")
    num_prompts: int = option(8, help="prompts decoded, one at a time")
    max_new_tokens: int = option(64, help="tokens generated per prompt")
    phase_repeats: int = option(5, help="repeats of each timed phase (median reported)")
    profile_dir: str | None = option(None, metavar="DIR", help="also trace --phase-repeats fused steps and as many "
                                     "plain decode steps, twice in turns, with the JAX profiler into DIR and print "
                                     "where each step's time goes: per kernel on a GPU or TPU, per XLA operation on "
                                     "a CPU")
    verify_sweep: str | None = option(None, help="comma-separated tree sizes M: time the verify forward vs a decode "
                                                 "step")
    runner_steps: str | None = option(None, help="comma-separated batch sizes: time the server's plain, target-only "
                                                 "and tree steps (PlainRunner / SpecRunner), each kind on its own "
                                                 "state, in blocks of steps back to back")
    context: int = option(512, help="prefix length for --verify-sweep, prompt length for --runner-steps")
    batch: int = option(1, help="batch for --verify-sweep")
    random_llama_8b: bool = option(False, help="random Llama-3.1-8B-shaped bf16 target")
    layers: int | None = option(None, help="with --random-llama-8b: number of layers (CPU smoke runs)")
    vs_llama_server: str | None = option(None, metavar="BIN", help="also run llama.cpp's llama-server binary (plain "
                                                                   "and EAGLE3) on the same prompts and weights")
    gguf: str | None = option(None, metavar="PATH", help="with --vs-llama-server: the target as GGUF (default: "
                                                         "SmolLM2's, dequantised to --dtype)")
    draft_gguf: str | None = option(None, metavar="PATH", help="with --vs-llama-server: the head as an EAGLE3 GGUF")
    llama_draft_n_max: tuple[int, ...] = option((3, 5, 7), help="llama.cpp EAGLE3 chain lengths tried "
                                                                "(--spec-draft-n-max)")
    llama_draft_p_min: float = option(0.0, help="llama.cpp's --spec-draft-p-min (0 = draft every step)")
    json: str | None = option(None, help="also write the results as JSON here")


def positive_ints(text: str, flag: str) -> list[int]:
    """``--flag 1,8,16`` as ints, each >= 1 (ValueError otherwise: one line from the bench tools)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated integers >= 1 (e.g. 1,8,16), got {text!r}")
    return values


def check_options(args: SpecOptions) -> None:
    """Refuse values no mode can run, before the model loads."""
    for flag in ("num_prompts", "max_new_tokens", "phase_repeats", "context", "batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("verify_sweep", "runner_steps"):
        if getattr(args, flag) is not None:
            positive_ints(getattr(args, flag), "--" + flag.replace("_", "-"))
    validate_tree(args.num_steps, args.topk, args.num_draft_tokens)  # was said after loading and warming up


def main(argv=None) -> int:
    args = parse_options(SpecOptions, argv, "python -m specjax.bench spec", __doc__)
    check_options(args)
    if args.profile_dir:
        enable_cpu_op_events()  # before the programs compile
    if args.verify_sweep:
        return report(args, bench_verify_sweep, print_sweep_table)
    if args.runner_steps:
        return report(args, bench_runner_steps, print_runner_table)
    return report(args, bench_spec, print_spec_table)


if __name__ == "__main__":
    sys.exit(main())
