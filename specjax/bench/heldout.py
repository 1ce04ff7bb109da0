"""Does the trainer's eval predict serving? The held-out split of a run, scored both ways with one exported head.

    python -m specjax.bench heldout --config smollm2-135m.yaml --draft HEAD_DIR [--num-steps 7 --topk 1
        --num-draft-tokens 8] [--max-prompts 32] [--max-new-tokens 256] [--dotted.overrides ...]

1. Predicted: the run's held-out conversations (rebuilt exactly as the trainer splits them: same data, same
   ``data.eval_fraction`` / ``eval_max`` / ``training.seed``) go through the trainer's eval step with the head. Two
   predictions of a chain of ``ttt_length`` steps come out of its TTT rollout: ``serving_accept_len``, the tokens
   per round of a greedy chain server walking the held-out answers (rounds summed over every held-out batch), and
   ``accept_len``, 1 + the leading correct draft steps averaged over every position (token-weighted), which
   over-states serving once errors cluster (train/loss.py says why).
2. Measured: each held-out conversation's first user turn is served with speculative decoding at
   (num_steps, topk, num_draft_tokens), greedy; tau = completion tokens / verify steps (SGLang's accept length).
The ratio is taken against the prediction over the served view (``served_view``: the served conversations' first
turns, cut at ``max_new_tokens`` answer tokens); the prediction over the whole split is printed beside it. With
regenerated data (the target's own greedy answers) the two see the same tokens, so they should agree; the
differences that remain are listed in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

from specjax.cli import from_namespace, option, options_parser
from specjax.head_weights import load_eagle3_head
from specjax.models import target
from specjax.sharding import make_mesh
from specjax.speculative.draft import make_draft
from specjax.speculative.spec_generate import speculative_generate
from specjax.train import data as data_lib, loss as loss_lib, train_step as step_lib
from specjax.train.config import add_override_options, config_from_command_line
from specjax.weights import load_model, resolve_model_path, stop_token_ids


def heldout_split(cfg, tokenizer):
    full = data_lib.load_dataset(cfg.data, tokenizer, log=lambda m: None)
    _, eval_data = data_lib.train_and_eval(cfg.data, full, tokenizer, cfg.training.seed, log=lambda m: None)
    return eval_data


def predicted_accept_len(cfg, tcfg, tparams, hcfg, hparams, vmap, eval_data, pad_id: int
                         ) -> tuple[float, float, list]:
    """The served prediction (round tokens / rounds over every held-out batch), the token-weighted per-position
    ``accept_len``, and acc_0..acc_{ttt-1}."""
    mesh = make_mesh(dp=1, tp=1, devices=jax.devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "dp"))
    ev = data_lib.BatchIterator(eval_data, shuffle=False, batch_size=cfg.training.batch_size, grad_accum=1,
                                buckets=cfg.data.buckets, max_length=cfg.data.max_length, seed=cfg.training.seed,
                                sharding=sharding, pad_id=pad_id)
    step = step_lib.make_eval_step(tcfg, hcfg.replace(dtype="float32"), mesh, ttt_length=cfg.training.ttt_length,
                                   decay=cfg.training.decay)
    params = jax.tree.map(lambda x: x.astype(np.float32), hparams)
    batches = []
    for _ in range(ev.steps_per_epoch):
        batch, _ = next(ev)
        batches.append(jax.device_get(step(params, tparams, vmap, batch)))
    m = loss_lib.pool_metrics(batches)
    return m["serving_accept_len"], m["accept_len"], [m[f"acc_{k}"] for k in range(cfg.training.ttt_length)]


def served_view(eval_data, limit: int, max_new_tokens: int) -> data_lib.TokenizedData:
    """The held-out conversations as they are served: the first ``limit``, each cut after its first assistant turn
    and after ``max_new_tokens`` answer tokens, so that the prediction walks exactly the tokens the server generates
    (a prediction over whole answers compared with 128 served tokens of 256-token answers read 0.87-0.88 where this
    view reads 1.0: docs/benchmarks.md, thirty-eighth session)."""
    parts = []
    for i in range(min(len(eval_data), limit)):
        t, m = eval_data.example(i)
        start = int(np.argmax(m > 0))
        turn = np.flatnonzero(m[start:] == 0)
        end = min(start + int(turn[0]) if len(turn) else len(t), start + max_new_tokens)
        parts.append((t[:end], m[:end]))
    return data_lib.TokenizedData.from_examples(parts, dict(eval_data.stats))


def first_turn_prompts(eval_data, limit: int) -> list[list[int]]:
    """Each held-out conversation's tokens up to its first loss-masked (assistant) token: the rendered (system +)
    first user turn and the assistant header, i.e. the generation prompt, exactly as the trainer tokenized it."""
    prompts = []
    for i in range(min(len(eval_data), limit)):
        toks, mask = eval_data.example(i)
        prompts.append(toks[: int(np.argmax(mask > 0))].tolist())
    return prompts


@dataclasses.dataclass
class HeldoutOptions:
    config: str = option("", required=True, help="the run config the head was trained with (name or path)")
    draft: str = option("", required=True, help="the exported head (HF EAGLE3 folder)")
    num_steps: int = option(7, help="tree depth (--speculative-num-steps)")
    topk: int = option(1, help="branching (--speculative-eagle-topk)")
    num_draft_tokens: int = option(8, help="tree size incl. the root (--speculative-num-draft-tokens)")
    max_prompts: int = option(32, help="held-out conversations served (default 32; 0 = only the prediction)")
    max_new_tokens: int = option(256, help="tokens generated per held-out prompt")


def main(argv=None) -> int:
    ap = add_override_options(options_parser(HeldoutOptions, "python -m specjax.bench heldout",
                                             __doc__.split("\n\n")[0]))
    if (got := config_from_command_line(ap, argv)) is None:
        return 2
    args, cfg = from_namespace(HeldoutOptions, got[0]), got[1]
    if args.max_prompts < 0 or args.max_new_tokens < 1:
        print(f"error: --max-prompts must be >= 0 and --max-new-tokens >= 1 (got {args.max_prompts} and "
              f"{args.max_new_tokens})", file=sys.stderr)
        return 2
    folder = resolve_model_path(cfg.model.path)
    tcfg, tparams = load_model(folder, dtype=cfg.model.dtype)
    tok = data_lib.load_tokenizer(cfg.model.tokenizer or folder)
    try:
        eval_data = heldout_split(cfg, tok)
    except data_lib.NoUsableData as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(eval_data) == 0:
        print("error: the run has no held-out split (data.eval_fraction is 0)", file=sys.stderr)
        return 2
    hcfg, hparams, vmap = load_eagle3_head(args.draft, tcfg, dtype="float32")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    predicted, per_position, accs = predicted_accept_len(cfg, tcfg, tparams, hcfg, hparams, vmap, eval_data, pad)
    print(f"held-out acc_0..acc_{len(accs) - 1} (token-weighted): " + " ".join(f"{a:.3f}" for a in accs))
    if args.max_prompts == 0:
        print(f"predicted chain accept length: {predicted:.3f} served ({per_position:.3f} averaged over positions)")
        return 0
    view = served_view(eval_data, args.max_prompts, args.max_new_tokens)
    predicted_view, _, _ = predicted_accept_len(cfg, tcfg, tparams, hcfg, hparams, vmap, view, pad)
    prompts = first_turn_prompts(eval_data, args.max_prompts)
    tparams = target.unstack_layers(tparams)  # the decode layout once, not in every call below
    draft = make_draft("EAGLE3", hcfg.replace(dtype=tcfg.dtype), jax.tree.map(
        lambda x: x.astype(tcfg.dtype), hparams), tparams, vmap)
    done = steps = 0
    for p in prompts:
        _, st = speculative_generate(tparams, tcfg, draft, [p], num_steps=args.num_steps, topk=args.topk,
                                     num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                                     stop_token_ids=stop_token_ids(folder, tcfg, tok))
        done += sum(st["completion_tokens"])
        steps += sum(st["verify_steps"])
    measured = done / max(steps, 1)
    chain = args.topk == 1 and args.num_steps == cfg.training.ttt_length
    ttt = cfg.training.ttt_length
    print(f"held-out conversations: {len(eval_data)}; {len(prompts)} served (first turns, max {args.max_new_tokens} "
          f"new tokens)")
    print(f"{f'predicted, all held-out, whole answers (chain of {ttt})':58s} {predicted:6.3f}")
    print(f"{'  (averaged over positions, not served)':58s} {per_position:6.3f}")
    print(f"{f'predicted, the served turns up to {args.max_new_tokens} tokens':58s} {predicted_view:6.3f}")
    print(f"{f'measured tau at ({args.num_steps},{args.topk},{args.num_draft_tokens})':58s} {measured:6.3f}")
    print(f"{'measured / predicted (the served turns)':58s} {measured / predicted_view:6.3f}" + ("" if chain else
          "   (not the same shape as the prediction: a chain of ttt_length steps)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
