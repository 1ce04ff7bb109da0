"""Train an EAGLE3 draft head against a frozen target.

    python -m specjax.train --config configs/qwen2.5-7b.yaml [--section.key VALUE ...]

Reads top to bottom: config -> distributed init -> mesh -> target (sharded) -> data -> vocab map -> train state
(restored or fresh) -> jitted step -> loop (progress, metrics, eval, checkpoints) -> final checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from specjax import configs
from specjax.cli import add_dotted_options, dotted_values
from specjax.train.config import ConfigError, RunConfig, load_config, parse_overrides, parse_value

HELP_EPILOG = """\
Every key of the run config can be overridden on the command line as --section.key VALUE, e.g.
  --optimizer.lr 3e-4  --mesh.tp 2  --training.max_steps 100  --data.buckets [512,1024]  --checkpoint.dir runs/x

Start here (CPU, a few minutes):
  python -m specjax.convert fetch-smollm2            # real SmolLM2-135M-Instruct into ~/.cache/specjax
  python -m specjax.convert fetch-sharegpt           # real ShareGPT chats (JSONL) into the same cache
  python -m specjax.train --config configs/smollm2-135m.yaml --data.max_examples 500 --training.max_steps 20

What happens:
  - the target (model.path: an HF folder with config.json, *.safetensors and a tokenizer with a chat template)
    is loaded frozen, sharded over the (dp, tp) mesh;
  - chats (data.paths / data.hf_datasets) are rendered with the target's chat template; only assistant tokens
    are trained on; lengths are bucketed (data.buckets) so only a few shapes compile;
  - the draft vocab map is computed from the data (or head.vocab_map / a fine-tuned head's own map);
  - checkpoints go to checkpoint.dir every checkpoint.every steps; re-running the same command resumes exactly;
    SIGTERM (preemption) saves a checkpoint and exits;
  - metrics go to <checkpoint.dir>/metrics.jsonl (loss, acc_k over valid positions, tokens/s, MFU).
Offline mode: --offline.dir DIR --offline.build true caches the target's features; then --offline.dir DIR trains
from the cache without running the target.
Multi-host (TPU pods): run the same command on every host (see tpu_scripts/README.md); jax.distributed is
initialised from the environment, or from --multihost.coordinator HOST:PORT --multihost.num_processes N
--multihost.process_id I.
Export the trained head: python -m specjax.convert export-head CHECKPOINT_DIR OUT_DIR
(every key, its meaning and its default: the sections above)
"""


def build_parser():
    """``--config`` plus one ``--section.key VALUE`` flag per key of the run config (help and default from the
    config's dataclasses)."""
    p = argparse.ArgumentParser(prog="python -m specjax.train", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [--config YAML] [--section.key VALUE ...]", epilog=HELP_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", help="run config YAML: a path, or the name of a shipped one from any directory ("
                   + ", ".join(configs.recipes()) + "); keys not given keep their defaults")
    return add_dotted_options(p, RunConfig, parse_value)


def parse_args(argv):
    """(args, overrides): the overrides are (section.key, value) pairs, those the parser knows and then whatever it
    does not (which ``load_config`` refuses with the valid keys and the nearest one)."""
    args, rest = build_parser().parse_known_args(argv)
    return args, dotted_values(args) + parse_overrides(rest)


def init_distributed(mh) -> None:
    """jax.distributed.initialize() when flags or the environment say there are several processes."""
    import jax
    env = os.environ
    explicit = mh.coordinator is not None
    auto = mh.auto or ("," in env.get("TPU_WORKER_HOSTNAMES", "") or int(env.get("SLURM_NTASKS", "1")) > 1
            or "JAX_COORDINATOR_ADDRESS" in env or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
    if not (explicit or auto):
        return
    if env.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        jax.distributed.initialize(coordinator_address=mh.coordinator, num_processes=mh.num_processes,
                                   process_id=mh.process_id)
    else:
        jax.distributed.initialize()


class Logger:
    """Process 0 writes metrics: JSONL always, TensorBoard when asked and available, progress bar when a tty."""

    def __init__(self, cfg, primary: bool):
        self.primary = primary
        ck = cfg.checkpoint.dir
        local = os.path.join("logs", os.path.basename(ck.rstrip("/")), "metrics.jsonl")  # for gs://... dirs
        self.path = cfg.logging.jsonl or (local if "://" in ck else os.path.join(ck, "metrics.jsonl"))
        self.tb = None
        if primary:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if cfg.logging.tensorboard:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError:
                    try:
                        from torch.utils.tensorboard import SummaryWriter
                    except ImportError:
                        SummaryWriter = None
                if SummaryWriter is None:
                    self.info("note: logging.tensorboard is set but neither tensorboardX nor torch's tensorboard is "
                              "installed; JSONL only")
                else:
                    self.tb = SummaryWriter(cfg.logging.tensorboard)
        self.bar = None

    def info(self, msg: str) -> None:
        if self.primary:
            (self.bar.write if self.bar is not None else print)(msg)
            sys.stdout.flush()

    def metrics(self, step: int, values: dict) -> None:
        if not self.primary:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def progress(self, total: int, initial: int, enabled: bool):
        if self.primary and enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
        return self.bar

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


class NonFiniteGuard:
    """Counts the updates the train step skipped for a non-finite loss or gradient, on the device (no host sync per
    step): the current run of consecutive skips, the longest run and the total. ``error`` (a sync: call it at
    logging and checkpoint steps) says why to stop once ``limit`` updates in a row were skipped."""

    def __init__(self, limit: int):
        import jax.numpy as jnp
        self.limit = max(int(limit), 1)
        self.run = self.longest = self.sum = jnp.zeros((), jnp.float32)

    def add(self, skipped) -> None:
        import jax.numpy as jnp
        self.run = jnp.where(skipped > 0, self.run + 1, 0.0)
        self.longest = jnp.maximum(self.longest, self.run)
        self.sum = self.sum + skipped

    def total(self) -> float:
        return float(self.sum)

    def error(self, step: int) -> str | None:
        if float(self.longest) < self.limit:
            return None
        return (f"{self.limit} updates in a row had a non-finite loss or gradient (by step {step}; "
                f"training.max_nonfinite_steps={self.limit}); each was skipped, none reached the weights")


# Dense bf16 peak FLOP/s per device, for MFU (None: unknown device, MFU not reported).
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
              "TPU v6 lite": 918e12, "TPU v6e": 918e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name.lower() in kind.lower():
            return PEAK_FLOPS[name]
    return None


def head_config(cfg, target_cfg):
    """The EAGLE3 head a run config asks for (before a checkpoint or init_from may replace it)."""
    from specjax.models.eagle3 import Eagle3Config
    return Eagle3Config.from_target(target_cfg, draft_vocab_size=cfg.head.draft_vocab_size,
                                    num_layers=cfg.head.num_layers, aux_layer_ids=cfg.head.aux_layer_ids,
                                    dtype=cfg.head.dtype)


def make_optimizer(cfg, total_steps: int):
    from specjax.train import step as step_lib
    return step_lib.make_optimizer(
        lr=cfg.optimizer.lr, total_steps=total_steps, warmup_ratio=cfg.optimizer.warmup_ratio,
        min_lr_ratio=cfg.optimizer.min_lr_ratio, weight_decay=cfg.optimizer.weight_decay, b1=cfg.optimizer.b1,
        b2=cfg.optimizer.b2, clip_norm=cfg.optimizer.clip_norm, grad_accum=cfg.training.grad_accum)


def main(argv=None) -> int:
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # ---- distributed, mesh ---------------------------------------------------------------------------------------
    init_distributed(cfg.multihost)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import weights
    from specjax.config import ModelConfig
    from specjax.models import target as target_lib
    from specjax.models import eagle3
    from specjax.sharding import make_mesh
    from specjax.train import checkpoint as ckpt_lib, data as data_lib, offline as offline_lib, step as step_lib
    from specjax.train.vocab import build_vocab_map, count_tokens, load_vocab_map

    primary = jax.process_index() == 0
    log = Logger(cfg, primary)
    tp = cfg.mesh.tp
    dp = cfg.mesh.dp if cfg.mesh.dp > 0 else jax.device_count() // tp
    mesh = make_mesh(dp=dp, tp=tp)
    if cfg.training.batch_size % dp:
        log.info(f"error: training.batch_size={cfg.training.batch_size} must be divisible by mesh.dp={dp}")
        return 2
    log.info(f"mesh dp={dp} tp={tp} on {jax.device_count()} {jax.devices()[0].platform} devices, "
             f"{jax.process_count()} process(es)")

    # ---- target ------------------------------------------------------------------------------------------------
    try:
        model_dir = weights.resolve_model_path(cfg.model.path)
        target_cfg = ModelConfig.from_pretrained(model_dir, dtype=cfg.model.dtype)
    except Exception as e:  # noqa: BLE001 - the message says what to do
        log.info(f"error: cannot use model.path={cfg.model.path!r}: {e}")
        if "smollm2" in (cfg.model.path or "").lower():
            log.info("fetch it with:  python -m specjax.convert fetch-smollm2   (into $SPECJAX_CACHE or "
                     "~/.cache/specjax; point --model.path at the folder it prints)")
        return 2
    offline_train = cfg.offline.dir is not None and not cfg.offline.build
    if cfg.model.random_init:
        target_params = weights.shard_params(target_lib.init_params(target_cfg, jax.random.PRNGKey(cfg.training.seed)),
                                             target_cfg, mesh)
        if offline_train:
            target_params = step_lib.target_embeddings(target_params)
    elif offline_train:
        target_params = offline_lib.load_target_embeddings(model_dir, target_cfg, mesh)
    else:
        target_params = weights.load_target_params(model_dir, target_cfg, mesh)
    log.info(f"target {target_cfg.architecture} ({target_cfg.num_params() / 1e6:.0f}M params, {target_cfg.dtype}) "
             f"from {model_dir}")

    # ---- data ----------------------------------------------------------------------------------------------------
    tokenizer = data_lib.load_tokenizer(cfg.model.tokenizer or model_dir)
    full = data_lib.load_dataset(cfg.data, tokenizer, log=log.info)
    train_data, eval_data = data_lib.split_eval(full, cfg.data.eval_fraction, cfg.data.eval_max, cfg.training.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_sharding = NamedSharding(mesh, P(None, "dp"))
    head_cfg = head_config(cfg, target_cfg)

    if cfg.offline.build:
        offline_lib.build_cache(cfg.offline.dir, full, target_cfg, head_cfg, target_params, mesh,
                                fingerprint=data_lib.fingerprint(cfg.data, tokenizer),
                                batch_size=cfg.training.batch_size, buckets=cfg.data.buckets,
                                max_length=cfg.data.max_length, pad_id=pad_id, log=log.info)
        return 0
    features = eval_features = None
    if offline_train:
        features = offline_lib.FeatureCache(cfg.offline.dir, expect_fingerprint=data_lib.fingerprint(cfg.data, tokenizer),
                                            expect_tokens=len(full.tokens))
        eval_features = features
    it_kw = dict(batch_size=cfg.training.batch_size, grad_accum=cfg.training.grad_accum, buckets=cfg.data.buckets,
                 max_length=cfg.data.max_length, seed=cfg.training.seed, sharding=batch_sharding, pad_id=pad_id)
    batches = data_lib.BatchIterator(train_data, features=features, **it_kw)
    total_steps = cfg.training.max_steps or cfg.training.epochs * batches.steps_per_epoch
    log.info(f"train: {len(train_data)} conversations, {batches.steps_per_epoch} steps/epoch "
             f"({cfg.training.grad_accum} x {cfg.training.batch_size} sequences/step), {total_steps} steps; "
             f"eval: {len(eval_data)} conversations")

    # ---- checkpoints, vocab map, state ------------------------------------------------------------------------------
    ckpt = ckpt_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    resume_step = ckpt.latest_step() if cfg.checkpoint.resume else None
    fresh_hint = "to start from scratch anyway pass --checkpoint.resume false"
    if cfg.checkpoint.resume and resume_step is None and (damaged := ckpt.damaged_steps_seen()):
        log.info(f"error: {cfg.checkpoint.dir} holds no usable checkpoint, only damaged ones moved aside "
                 f"({', '.join(damaged)}); {fresh_hint}")
        return 1
    optimizer = make_optimizer(cfg, total_steps)
    rep = NamedSharding(mesh, P())
    init_params = restored = None
    if resume_step is not None:
        def resume_abstract(meta):  # the run's head, as saved in the step being restored
            hc = ckpt_lib.head_config_from_dict(meta["head_config"]).replace(dtype=head_cfg.dtype)
            st = step_lib.abstract_train_state(hc, optimizer, mesh)
            return {"params": st.params, "train": {"opt_state": st.opt_state, "step": st.step, "rng": st.rng},
                    "vocab": {"d2t": jax.ShapeDtypeStruct((hc.draft_vocab_size,), np.int32, sharding=rep),
                              "t2d": jax.ShapeDtypeStruct((target_cfg.vocab_size,), np.bool_, sharding=rep)}}
        try:  # the newest step that passes its checksums and loads; damaged ones are moved aside
            resume_step, restored = ckpt.restore(abstract=resume_abstract)
        except ckpt_lib.CheckpointError as e:
            log.info(f"error: {e}; {fresh_hint}")
            return 1
        vocab_source = f"checkpoint step {resume_step}"
        head_cfg = ckpt_lib.head_config_from_dict(restored["meta"]["head_config"]).replace(dtype=head_cfg.dtype)
    elif cfg.head.init_from:
        head0, init_params, vocab_map, _ = ckpt_lib.load_head_for_export(cfg.head.init_from)
        if (head0.vocab_size, head0.target_hidden_size) != (target_cfg.vocab_size, target_cfg.hidden_size):
            log.info(f"error: head.init_from={cfg.head.init_from} was trained for a target with vocab "
                     f"{head0.vocab_size} and hidden {head0.target_hidden_size}, not this one "
                     f"({target_cfg.vocab_size}, {target_cfg.hidden_size})")
            return 2
        head_cfg = head0.replace(dtype=head_cfg.dtype)  # the head keeps its own shape, aux layers and vocab map
        vocab_source = f"head {cfg.head.init_from}"
    elif cfg.head.vocab_map:
        vocab_map = load_vocab_map(cfg.head.vocab_map)
        if len(vocab_map.t2d) != target_cfg.vocab_size:
            log.info(f"error: head.vocab_map={cfg.head.vocab_map} maps a vocab of {len(vocab_map.t2d)} ids, the target "
                     f"has {target_cfg.vocab_size}")
            return 2
        head_cfg = head_cfg.replace(draft_vocab_size=len(vocab_map.d2t))
        vocab_source = cfg.head.vocab_map
    else:
        counts = count_tokens(train_data.tokens, train_data.loss_mask, target_cfg.vocab_size)
        vocab_map = build_vocab_map(counts, head_cfg.draft_vocab_size)
        vocab_source = f"counted over {int(counts.sum())} training tokens"
    if restored is not None:
        out = restored
        state = step_lib.TrainState(params=out["params"], opt_state=out["train"]["opt_state"],
                                    step=out["train"]["step"], rng=out["train"]["rng"])
        from specjax.models.eagle3 import VocabMap
        vocab_map = VocabMap(d2t=out["vocab"]["d2t"], t2d=out["vocab"]["t2d"])
        batches.load_state_dict(out["meta"]["data_state"])
        log.info(f"resumed from {cfg.checkpoint.dir} step {resume_step} (data epoch {batches.epoch}, "
                 f"batch {batches.position})")
    else:
        if init_params is not None:  # host copies -> replicated global arrays (any number of processes)
            init_params = jax.tree.map(lambda x: jax.make_array_from_callback(
                x.shape, rep, lambda idx, x=np.asarray(jax.device_get(x)): x[idx]), init_params)
        if init_params is None and cfg.head.init_lm_head == "target":
            init_params = eagle3.init_params_from_target(
                head_cfg.replace(dtype="float32"), jax.random.PRNGKey(cfg.training.seed), target_params.embed,
                target_params.lm_head, getattr(target_params, "final_norm", None), vocab_map)
            vocab_source += "; lm_head and norm from the target"
        state = step_lib.init_train_state(head_cfg, cfg.training.seed, optimizer, mesh, init_params=init_params)
    vocab_map = jax.device_put(vocab_map, rep)
    log.info(f"head: {head_cfg.num_layers} layer(s), hidden {head_cfg.hidden_size}, draft vocab "
             f"{head_cfg.draft_vocab_size} ({vocab_source}), aux layers {list(head_cfg.aux_layer_ids)}")

    # ---- jitted step, eval -------------------------------------------------------------------------------------------
    make = step_lib.make_train_step_offline if offline_train else step_lib.make_train_step
    train_step = make(target_cfg, head_cfg, optimizer, mesh, ttt_length=cfg.training.ttt_length,
                      decay=cfg.training.decay, grad_accum=cfg.training.grad_accum)
    eval_step = step_lib.make_eval_step(target_cfg, head_cfg, mesh, ttt_length=cfg.training.ttt_length,
                                        decay=cfg.training.decay, offline=offline_train)
    target_arg = target_params

    def run_eval() -> dict:
        if len(eval_data) == 0:
            return {}
        ev = data_lib.BatchIterator(eval_data, shuffle=False, features=eval_features, **it_kw)
        n = min(cfg.logging.eval_batches, ev.steps_per_epoch)
        sums: dict[str, float] = {}
        for _ in range(n):
            batch, _ = next(ev)
            m = jax.device_get(eval_step(state.params, target_arg, vocab_map, batch))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return {f"eval_{k}": v / n for k, v in sums.items()}

    def meta() -> dict:
        return {"run_config": cfg.to_dict(), "head_config": ckpt_lib.head_config_to_dict(head_cfg),
                "target_model_path": os.path.abspath(model_dir) if os.path.isdir(model_dir) else model_dir,
                "data_state": batches.state_dict(), "total_steps": total_steps, "vocab_source": vocab_source}

    saved = {"step": resume_step}

    def save(step: int, wait: bool = False) -> None:
        if saved["step"] == step:
            return
        saved["step"] = step
        ckpt.save(step, params=state.params, train={"opt_state": state.opt_state, "step": state.step,
                                                    "rng": state.rng}, vocab=vocab_map, meta=meta(), wait=wait)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def should_stop(step: int) -> bool:
        flag = stop["signal"] is not None
        if jax.process_count() > 1:
            # every host must stop at the same step: agree on the flag, but only at logging steps (which sync
            # with the devices anyway) so that the host keeps running ahead of the devices in between
            if step % cfg.logging.every and step < total_steps:
                return False
            from jax.experimental import multihost_utils
            flag = bool(np.asarray(multihost_utils.process_allgather(np.asarray(flag))).any())
        return flag

    # ---- the loop ----------------------------------------------------------------------------------------------------
    step = int(jax.device_get(state.step))
    peak = peak_flops(jax.devices()[0])
    n_dev = jax.device_count()
    bar = log.progress(total_steps, step, cfg.logging.progress)
    window_tokens, window_start, window_flops = 0, time.perf_counter(), 0.0
    nonfinite = NonFiniteGuard(cfg.training.max_nonfinite_steps)
    while step < total_steps:
        batch, info = next(batches)
        state, metrics = train_step(state, target_arg, vocab_map, batch)
        step += 1
        nonfinite.add(metrics["skipped"])
        window_tokens += info["tokens"]
        window_flops += info["tokens"] * step_lib.estimate_flops_per_token(
            target_cfg, head_cfg, info["seq_len"], cfg.training.ttt_length, include_target=not offline_train)
        if step % cfg.logging.every == 0 or step == total_steps:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = max(time.perf_counter() - window_start, 1e-9)
            m.update(epoch=batches.epoch, seq_len=info["seq_len"], tokens_per_s=window_tokens / dt,
                     time=time.time())
            if peak is not None:
                m["mfu"] = window_flops / dt / (peak * n_dev)
            m["skipped_total"] = nonfinite.total()
            if m["skipped"]:
                log.info(f"warning: non-finite loss or gradient at step {step}; the update was skipped "
                         f"({m['skipped_total']:.0f} skipped so far)")
            log.metrics(step, m)
            if bar is not None:
                bar.set_postfix({"loss": f"{m['loss']:.3f}", "acc_0": f"{m.get('acc_0', float('nan')):.3f}",
                                 "tok/s": f"{m['tokens_per_s']:.0f}",
                                 **({"mfu": f"{m['mfu']:.1%}"} if "mfu" in m else {})})
            elif primary:
                print(f"step {step}/{total_steps} loss {m['loss']:.4f} acc_0 {m.get('acc_0', float('nan')):.3f} "
                      f"tok/s {m['tokens_per_s']:.0f}" + (f" mfu {m['mfu']:.1%}" if "mfu" in m else ""), flush=True)
            window_tokens, window_start, window_flops = 0, time.perf_counter(), 0.0
        if bar is not None:
            bar.update(1)
        if cfg.logging.eval_every and step % cfg.logging.eval_every == 0:
            em = run_eval()
            if em:
                log.metrics(step, em)
                accs = " ".join(f"{em[f'eval_acc_{k}']:.3f}" for k in range(cfg.training.ttt_length)
                                if f"eval_acc_{k}" in em)
                log.info(f"eval at step {step}: loss {em['eval_loss']:.4f} acc_0..{cfg.training.ttt_length - 1} "
                         f"{accs} predicted chain accept length {em.get('eval_accept_len', float('nan')):.2f}")
        if (step % cfg.logging.every == 0 or step % cfg.checkpoint.every == 0 or step == total_steps) and \
                (err := nonfinite.error(step)):
            log.info(f"error: {err}; the last checkpoint in {cfg.checkpoint.dir} (step {saved['step']}) holds "
                     f"finite weights: lower optimizer.lr or check the data, then resume")
            ckpt.close()
            log.close()
            return 1
        if step % cfg.checkpoint.every == 0 and step < total_steps:
            save(step)
        ckpt.poll()
        if should_stop(step):
            log.info(f"signal {stop['signal']}: saving a checkpoint at step {step} and exiting")
            break
    save(step, wait=True)
    ckpt.close()
    log.close()
    log.info(f"done at step {step}; checkpoint in {cfg.checkpoint.dir}; export with: python -m specjax.convert "
             f"export-head {cfg.checkpoint.dir} OUT_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
