"""Search the speculative tree shape per batch size on a prompt set; write the table next to the head.

    python -m specjax.bench tune --draft HEAD_DIR [--model PATH] [--batch-sizes 1 4 16]
        [--shapes 1,2,3 3,2,5 5,4,8 ...] [--prompts mtbench] [--num-prompts 16]
        [--max-new-tokens 256] [--temperature 0] [--out HEAD_DIR/speculative_tune.json] [--no-write]
    python -m specjax.bench tune --draft HEAD_DIR --batch-sizes 1 --shapes 1,2,3 --num-prompts 80 \
        --max-new-tokens 256 --outputs-only     # speculative greedy == plain greedy on all of MT-bench, and tau

For every batch size B, the prompts are decoded in groups of B rows, once by plain decoding (``specjax.generate``)
and once per shape (num_steps, eagle_topk, num_draft_tokens) by ``speculative_generate``; each configuration runs
every group once untimed (compiles every shape) then once timed. Without ``--shapes`` the candidates depend on the
backend (``DEFAULT_SHAPES``: small trees on a CPU, up to 60 tokens on an accelerator). The fastest configuration
per B wins, by ``--min-gain`` (3%) over the fastest before it in the order plain, then the shapes as given: one
timed pass per configuration cannot tell apart gains inside the machine's noise, so those keep the earlier, cheaper
choice. Plain wins where no shape beats it so (the server then starts that batch size with target-only steps, and
the rows' costs let it turn the tree on where live traffic pays for it). Printed per row: tokens/s, speedup over
plain, tau (completion tokens / verify steps) and, at temperature 0, how many outputs equal plain greedy token for
token; a shape with any other output (a numerical bug: greedy speculation is lossless by construction) is flagged
and never chosen.
``--outputs-only`` runs every group once, untimed and uncompiled beforehand, for the outputs and tau alone (half
the time; its tokens/s include compiles and are not written).

The file (``speculative_tune.json``, format 1) holds ``{"format": 1, "algorithm", "target", "machine",
"batch_sizes": {"1": {"num_steps", "eagle_topk", "num_draft_tokens"} | null, ...}, "rows": [...]}`` where null means
plain decoding is faster at that batch size. ``specjax.serve`` and ``specjax.Engine`` read it from the draft folder
when the tree flags are not given (``specjax.speculative.tune.load_tune``). With ``--dtype bfloat16`` (or float16)
the table goes to ``speculative_tune.<dtype>.json``, which servers of that dtype read instead. Where the head's
table was measured on another kind of machine (a shipped head's), it is kept and this machine's is written beside it
(``speculative_tune[.<dtype>].on-<machine>.json``, ``tune.machine_tag``); runs on this kind of machine read it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax

from specjax import head_weights
from specjax.batching import warmup_budget
from specjax.bench.common import TargetRunOptions, machine_description, write_json
from specjax.bench.spec import load_prompts, load_target, prompt_texts
from specjax.cli import check_output_file, option, options_parser, parse_into
from specjax.speculative import tune as tune_lib

# The candidate shapes when --shapes is not given, by backend. A CPU verifies a few tree tokens for little more than
# one decode step and a 32- or 60-token tree for 2-4 steps, so its candidates are small trees, branching at 2 or 4
# where a chain's next token is uncertain (on two cores at batch 1 over 256-token MT-bench answers, fifty-fourth
# session: (3,2,5) tau 2.01 at 1.65x plain, (5,4,8) 2.26 at 1.57x, (1,2,3) 1.60 at 1.48x, (6,4,10) 2.31 at 1.22x).
# An accelerator verifies tens of tokens for about one step: the issue table's six, SGLang's range.
DEFAULT_SHAPES = {"cpu": ("1,2,3", "2,2,4", "3,1,4", "3,2,5", "4,2,6", "5,2,6", "5,4,8", "7,1,8"),
                  "accelerator": ("3,1,4", "5,1,6", "7,1,8", "5,4,8", "5,8,32", "6,10,60")}


def default_shapes(backend: str) -> tuple[tuple[int, int, int], ...]:
    """The candidate tree shapes ``bench tune`` measures on ``backend`` when none are given."""
    return tuple(_parse_shape(s) for s in DEFAULT_SHAPES["cpu" if backend == "cpu" else "accelerator"])


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        steps, topk, draft = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is STEPS,TOPK,DRAFT_TOKENS (e.g. 7,1,8), got {text!r}") from None
    from specjax.speculative.tree import validate
    try:
        validate(steps, topk, draft)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return steps, topk, draft


def _time_groups(run, groups, max_new_tokens: int, warm: bool = True) -> tuple[float, list[list[int]], int]:
    """Seconds to run every group (``run(group, max_new_tokens=...)``), outputs, verify steps; with ``warm``, every
    group runs a warm-up call first (``warmup_budget``: prompt lengths are bucketed, so groups may compile different
    shapes)."""
    for g in groups if warm else ():
        run(g, **warmup_budget(max_new_tokens))
    t0 = time.perf_counter()
    outs, steps = [], 0
    for g in groups:
        o, s = run(g, max_new_tokens=max_new_tokens)
        outs.extend(o)
        steps += s
    return time.perf_counter() - t0, outs, steps


def tune(args) -> dict:
    from specjax.generate import generate
    from specjax.speculative import draft as draft_lib
    from specjax.speculative.spec_generate import speculative_generate

    texts = None if args.prompts == "random" else prompt_texts(args.prompts, args.num_prompts)  # before the model
    tcfg, tparams, tokenizer, model_note = load_target(args)
    dcfg, dparams, vocab = head_weights.load_draft(args.draft, args.algorithm, tcfg,
                                                   token_map=args.speculative_token_map)
    draft = draft_lib.make_draft(args.algorithm, dcfg, dparams, tparams, vocab)
    prompts, prompt_note = load_prompts(args.prompts, tokenizer, args.num_prompts, tcfg.vocab_size, texts)
    kw = dict(stop_token_ids=tuple(tcfg.eos_token_ids), temperature=args.temperature, seed=args.seed)
    rows, best, best_spec = [], {}, {}
    for b in args.batch_sizes:
        groups = [prompts[i:i + b] for i in range(0, len(prompts) - b + 1, b)]
        if not groups:
            raise SystemExit(f"--num-prompts {len(prompts)} is smaller than batch size {b}")
        warm = not args.outputs_only
        t, plain_out, _ = _time_groups(lambda g, **budget: (generate(tparams, tcfg, g, **kw, **budget), 0), groups,
                                       args.max_new_tokens, warm)
        n = sum(len(o) for o in plain_out)
        plain = dict(batch_size=b, shape=None, tok_s=n / t, speedup=1.0, tau=1.0, identical=None)
        rows.append(plain)
        print(f"  B={b:<3d} plain      {plain['tok_s']:8.1f} tok/s", file=sys.stderr, flush=True)
        best[b] = plain
        for shape in args.shapes:
            def run(g, shape=shape, **budget):
                out, info = speculative_generate(
                    tparams, tcfg, draft, g, algorithm=args.algorithm, num_steps=shape[0], topk=shape[1],
                    num_draft_tokens=shape[2], attention_impl=args.attention_impl, **kw, **budget)
                return out, int(sum(info["verify_steps"]))
            t, outs, steps = _time_groups(run, groups, args.max_new_tokens, warm)
            # Each shape compiles a program per prompt bucket, and XLA:CPU maps memory for every kernel of every
            # live program: free this shape's before the next (a long sweep ran out of memory maps otherwise).
            jax.clear_caches()
            n = sum(len(o) for o in outs)
            same = sum(a == p for a, p in zip(outs, plain_out)) if args.temperature == 0 else None
            row = dict(batch_size=b, shape=list(shape), tok_s=n / t, speedup=(n / t) / plain["tok_s"],
                       tau=n / max(steps, 1), identical=same)
            rows.append(row)
            # Greedy speculative output is plain greedy output by construction: a shape that gave another answer
            # shows a numerical bug and is never chosen (it is reported).
            lossy = same is not None and same < len(outs)
            print(f"  B={b:<3d} {shape!s:10s} {row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  tau {row['tau']:.2f}"
                  + (f"  NOT CHOSEN: {len(outs) - same}/{len(outs)} outputs differ from plain greedy" if lossy else ""),
                  file=sys.stderr, flush=True)
            if lossy:
                continue
            if row["tok_s"] > best[b]["tok_s"] * (1 + args.min_gain):
                best[b] = row
            if b not in best_spec or row["tok_s"] > best_spec[b]["tok_s"]:
                best_spec[b] = row
    return dict(format=tune_lib.FORMAT, algorithm=args.algorithm, target=model_note, draft=args.draft,
                prompts=prompt_note, num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, timed=not args.outputs_only,
                machine=machine_description(),
                load_average=os.getloadavg()[0],
                batch_sizes={str(b): (dict(zip(("num_steps", "eagle_topk", "num_draft_tokens"), r["shape"]))
                                      if r["shape"] else None) for b, r in best.items()},
                best_speculative={str(b): dict(zip(("num_steps", "eagle_topk", "num_draft_tokens"), r["shape"]))
                                  for b, r in best_spec.items()},
                rows=rows)


def print_table(r: dict) -> None:
    print(f"target: {r['target']}\ndraft: {r['draft']} ({r['algorithm']})\nprompts: {r['prompts']}, "
          f"{r['num_prompts']} prompts, max {r['max_new_tokens']} new tokens, temperature {r['temperature']}; "
          f"{r['machine']}, load average {r['load_average']:.2f}" + ("" if r.get("timed", True) else
                                                                       "; --outputs-only: tok/s include compiles"))
    print(f"{'batch':>5s}  {'steps,topk,draft':>16s}  {'tok/s':>8s}  {'speedup':>7s}  {'tau':>5s}  {'== plain':>8s}")
    for row in r["rows"]:
        shape = "plain" if row["shape"] is None else ",".join(map(str, row["shape"]))
        whole = r['num_prompts'] // row['batch_size'] * row['batch_size']  # prompts in whole batches
        same = "" if row["identical"] is None else f"{row['identical']}/{whole}"
        print(f"{row['batch_size']:5d}  {shape:>16s}  {row['tok_s']:8.1f}  {row['speedup']:7.2f}  {row['tau']:5.2f}  "
              f"{same:>8s}")
    print("chosen: " + ", ".join(f"B={b}: {'plain' if s is None else ','.join(map(str, s.values()))}"
                                 for b, s in r["batch_sizes"].items()))


@dataclasses.dataclass
class TuneOptions(TargetRunOptions):
    draft: str = option("", required=True, help="draft head folder (HF format)")
    model: str | None = option(None, help="target folder (default: the SmolLM2 cache of `convert fetch-smollm2`)")
    algorithm: str = option("EAGLE3", type=str.upper, choices=["EAGLE3", "EAGLE"], help="draft head kind")
    speculative_token_map: str | None = option(None, help="FR-Spec hot-token list for EAGLE heads")
    batch_sizes: tuple[int, ...] = option((1, 4, 16), help="batch sizes to tune, one table each")
    shapes: tuple[tuple[int, int, int], ...] = option(
        (), type=_parse_shape, metavar="STEPS,TOPK,DRAFT",
        help="tree shapes to measure (num_steps,eagle_topk,num_draft_tokens); default on a CPU: "
             + " ".join(DEFAULT_SHAPES["cpu"]) + "; on an accelerator: " + " ".join(DEFAULT_SHAPES["accelerator"]))
    prompts: str = option("mtbench", help="mtbench (default), random, or a .jsonl/.txt file")
    num_prompts: int = option(16, help="prompts per measurement")
    max_new_tokens: int = option(256, help="tokens generated per prompt (a head is accepted for more tokens further "
                                           "into an answer, deep trees most: tune at the lengths served)")
    temperature: float = option(0.0, help="0 = greedy (default)")
    seed: int = option(0, help="sampling seed")
    out: str | None = option(None, help="where to write the table (default: DRAFT/speculative_tune.json, or "
                                          "DRAFT/speculative_tune.DTYPE.json with --dtype bfloat16 or float16; "
                                          "where that table was measured on another kind of machine, it is kept "
                                          "and this machine's goes beside it as speculative_tune[.DTYPE]."
                                          "on-MACHINE.json)")
    no_write: bool = option(False, help="print only")
    min_gain: float = option(0.03, help="a configuration is chosen over the faster-so-far one (plain first, then the "
                                        "shapes in the order given) only when its tok/s is higher by this fraction: "
                                        "one timed pass each, so a gain within the machine's noise keeps the "
                                        "earlier, cheaper choice")
    outputs_only: bool = option(False, help="run each group once without a warm-up pass: outputs (== plain) and "
                                            "tau only, tokens/s include compiles; writes no table")
    json: str | None = option(None, help="also write the full results here")
    random_llama_8b: bool = False  # the target is always a real model here (bench spec's load_target reads it)


def table_output(args) -> str | None:
    """Where the table goes: ``--out``, else into the head's folder (a hub head's hub-cache folder, where serving it
    by the same id reads it); None with ``--no-write`` or ``--outputs-only``."""
    if args.no_write or args.outputs_only:
        return None
    return args.out or tune_lib.output_path(head_weights.resolve_head_path(args.draft), args.dtype)


def main(argv=None) -> int:
    ap = options_parser(TuneOptions, "python -m specjax.bench tune", __doc__.split("\n\n")[0],
                        exclude=("random_llama_8b",))
    args = parse_into(TuneOptions, ap, argv)
    if any(b < 1 for b in args.batch_sizes) or args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--batch-sizes, --num-prompts and --max-new-tokens must be >= 1")
    if not 0 <= args.min_gain < 1:
        ap.error(f"--min-gain must be in [0, 1), got {args.min_gain}")
    if args.num_prompts < max(args.batch_sizes):  # checked before any measurement, not after an hour of them
        ap.error(f"--num-prompts {args.num_prompts} is smaller than batch size {max(args.batch_sizes)}: every batch "
                 f"size needs at least one full group of prompts")
    out = table_output(args)
    check_output_file(out, "--out")  # now, not after an hour of measurements
    check_output_file(args.json, "--json")
    args.shapes = args.shapes or default_shapes(jax.default_backend())
    r = tune(args)
    print_table(r)
    if out:
        tune_lib.save_tune(out, r)
        print(f"wrote {out}")
    write_json(args.json, r, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
