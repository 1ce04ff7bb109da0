"""Train an EAGLE3 draft head against a frozen target.

    python -m specjax.train --config configs/qwen2.5-7b.yaml [--section.key VALUE ...]

Reads top to bottom: config -> distributed init -> mesh -> target (sharded) -> data -> vocab map -> train state
(restored or fresh) -> jitted step -> loop (progress, metrics, eval, checkpoints) -> final checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import configs, weights
from specjax.cli import check_output_file, error_text
from specjax.config import ModelConfig
from specjax.head_weights import (HF_HEAD_FILES, HeadFormatError, export_head, is_hf_eagle3_head,
                                  load_eagle3_head)
from specjax.host import reuse_cpu_temps
from specjax.hub import enable_compilation_cache
from specjax.models import eagle3, target as target_lib
from specjax.models.eagle3 import Eagle3Config, VocabMap
from specjax.sharding import ShardingError, agree_on_error, make_mesh
from specjax.train import (checkpoint as ckpt_lib, data as data_lib, loss as loss_lib, offline as offline_lib,
                           train_step as step_lib)
from specjax.train.config import HeadConfig, RunConfig, add_override_options, config_from_command_line
from specjax.train.vocab import build_vocab_map, count_tokens, load_vocab_counts, load_vocab_map, widen_vocab_map

HELP_EPILOG = """\
Every key of the run config can be overridden on the command line as --section.key VALUE, e.g.
  --optimizer.lr 3e-4  --mesh.tp 2  --training.max_steps 100  --data.buckets [512,1024]  --checkpoint.dir runs/x

Start here (CPU, a few minutes):
  python -m specjax.convert fetch-smollm2            # real SmolLM2-135M-Instruct into ~/.cache/specjax
  python -m specjax.convert fetch-sharegpt           # real ShareGPT chats (JSONL) into the same cache
  python -m specjax.train --config configs/smollm2-135m.yaml --data.paths sharegpt --data.max_examples 500 \\
      --training.max_steps 20   # ShareGPT's own answers; the recipe trains on the target's regenerated ones
                                # (python -m specjax.train.regenerate: see configs/smollm2-135m.yaml)

What happens:
  - the target (model.path: an HF folder with config.json, *.safetensors and a tokenizer with a chat template;
    preformatted text with data.assistant_header and data.end_of_turn needs none)
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
    return add_override_options(p)


def init_distributed(mh) -> None:
    """jax.distributed.initialize() when flags or the environment say there are several processes."""
    env = os.environ
    explicit = mh.coordinator is not None
    auto = mh.auto or ("," in env.get("TPU_WORKER_HOSTNAMES", "") or int(env.get("SLURM_NTASKS", "1")) > 1
            or "JAX_COORDINATOR_ADDRESS" in env or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
    if not (explicit or auto):
        return
    if env.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    who = f"process {mh.process_id} of {mh.num_processes} via {mh.coordinator}" if explicit else "from the environment"
    print(f"multihost: connecting the processes ({who}); jax waits about 5 minutes for every one of them, then stops "
          f"with its own fatal error", flush=True)
    if explicit:
        jax.distributed.initialize(coordinator_address=mh.coordinator, num_processes=mh.num_processes,
                                   process_id=mh.process_id)
    else:
        jax.distributed.initialize()


# Run-config keys that are not what a run trains: how it resumes, how its processes meet, host-local places and
# display (they may differ between a run and its resume, or between the hosts of one run).
NOT_SETTINGS = ("checkpoint.resume", "multihost.", "data.cache_dir", "logging.progress", "logging.jsonl",
                "logging.tensorboard")


def run_settings(d: dict, prefix: str = "") -> dict[str, Any]:
    """A run config's dict flattened to ``section.key: value``, without :data:`NOT_SETTINGS`."""
    out = {}
    for k, v in d.items():
        name = prefix + k
        if isinstance(v, dict):
            out.update(run_settings(v, name + "."))
        elif not any(name == n or (n.endswith(".") and name.startswith(n)) for n in NOT_SETTINGS):
            out[name] = v
    return out


def _digest(value) -> int:
    """31 bits of the SHA-256 of ``value``'s JSON (an int32 that every backend gathers as it is)."""
    raw = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(raw[:4], "little") >> 1


def check_processes_agree(cfg: RunConfig) -> None:
    """Before the target loads, on every process alike (a :class:`Stop` or an OSError on all of them): gs:// paths
    have a filesystem here, the processes run the same settings, and the checkpoint folder is one folder that all
    of them can write (made now; a setup error later removes it again while it holds no files)."""
    err = None
    try:
        for path in (cfg.checkpoint.dir, cfg.head.init_from):
            ckpt_lib.check_filesystem(path or "")
    except OSError as e:
        err = str(e)
    if err := agree_on_error(err):
        raise Stop(2, f"error: {err}")
    check_same_config(cfg)
    ckpt_lib.open_shared_dir(ckpt_lib.checkpoint_root(cfg.checkpoint.dir))


def check_same_config(cfg: RunConfig) -> None:
    """With several processes: a :class:`Stop` on every process unless all run the same settings
    (:func:`run_settings`), naming the keys that differ. Different seeds gave each host another "replicated" head and
    vocab map in silence; other differences ended minutes later in a collective mismatch or a barrier timeout."""
    if jax.process_count() == 1:
        return
    flat = run_settings(cfg.to_dict())
    keys = sorted(flat)
    mine = np.asarray([_digest(keys)] + [_digest(flat[k]) for k in keys], np.int32)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(mine)))).reshape(-1)
    every = (np.asarray(multihost_utils.process_allgather(mine)).reshape(len(sizes), -1)
             if len(set(sizes.tolist())) == 1 else None)
    if every is None or (every[:, 0] != every[0, 0]).any():
        raise Stop(2, "error: the processes run different specjax versions (their run configs have different keys): "
                      "install the same checkout on every host")
    differ = [k for i, k in enumerate(keys, 1) if (every[:, i] != every[0, i]).any()]
    if differ:
        raise Stop(2, f"error: the processes were started with different settings: {', '.join(differ[:8])}"
                      f"{' ...' if len(differ) > 8 else ''} (this process: "
                      f"{', '.join(f'{k}={flat[k]}' for k in differ[:4])}); every host must run the same command "
                      f"and config")


class Logger:
    """Process 0 writes metrics: JSONL always, TensorBoard when asked and available, progress bar when a tty."""

    def __init__(self, cfg, primary: bool):
        self.primary = primary
        ck = cfg.checkpoint.dir
        local = os.path.join("logs", os.path.basename(ck.rstrip("/")), "metrics.jsonl")  # for gs://... dirs
        self.path = cfg.logging.jsonl or (local if "://" in ck else os.path.join(ck, "metrics.jsonl"))
        self.tb = self.wandb = self.bar = None  # (the bar first: the notes below print through ``info``)
        if primary:
            try:
                check_output_file(self.path, "logging.jsonl")
            except ValueError as e:
                raise Stop(2, f"error: {e}") from None
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
            if cfg.logging.wandb_project:
                self.wandb = self._start_wandb(cfg)

    def _start_wandb(self, cfg):
        """A wandb run for ``logging.wandb_project`` (SpecForge's --report-to wandb), or None with a note when wandb
        is not installed. Its id comes from the checkpoint folder, so a resumed run continues the same wandb run."""
        try:
            import wandb
        except ImportError:
            self.info("note: logging.wandb_project is set but wandb is not installed (pip install wandb); JSONL only")
            return None
        ck = cfg.checkpoint.dir
        run_id = hashlib.sha256(os.path.abspath(ck).encode() if "://" not in ck else ck.encode()).hexdigest()[:16]
        return wandb.init(project=cfg.logging.wandb_project, id=run_id, resume="allow",
                          name=cfg.logging.wandb_name or os.path.basename(ck.rstrip("/")),
                          config=dataclasses.asdict(cfg))

    def info(self, msg: str) -> None:
        if self.primary:
            (self.bar.write if self.bar is not None else print)(msg)
            sys.stdout.flush()

    def metrics(self, step: int, values: dict) -> None:
        if not self.primary:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

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
        if self.wandb is not None:
            self.wandb.finish()


class Streak:
    """Steps in a row on which a per-step flag (a device scalar, 1.0 or 0.0) was set, counted on the device (no host
    sync per step): the current run, the longest run and the total. ``reached`` (a sync: call it at logging and
    checkpoint steps) says whether ``limit`` flags in a row were seen: in the longest run, or with ``ongoing`` only
    in the run still going on."""

    def __init__(self, limit: int):
        self.limit = max(int(limit), 1)
        self.run = self.longest = self.sum = jnp.zeros((), jnp.float32)

    def add(self, flag) -> None:
        self.run = jnp.where(flag > 0, self.run + 1, 0.0)
        self.longest = jnp.maximum(self.longest, self.run)
        self.sum = self.sum + flag

    def total(self) -> float:
        return float(self.sum)

    def current(self) -> int:
        return int(self.run)

    def reached(self, ongoing: bool = False) -> bool:
        return float(self.run if ongoing else self.longest) >= self.limit


def stop_reason(run: Run, nonfinite: Streak, stalled: Streak, step: int) -> str | None:
    """Why the run must stop at ``step``, naming what its checkpoints hold; None to go on. A skipped (non-finite)
    update never reaches the weights, so the last checkpoint is good; a gradient of exactly zero on batches with
    answer tokens means the head saturated (the usual cause: a learning rate far too high) and no longer learns:
    checkpoints saved since it began hold that head."""
    cfg = run.cfg
    if nonfinite.reached():
        last = (f"the last checkpoint in {cfg.checkpoint.dir} (step {run.saved_step}) holds finite weights"
                if run.saved_step is not None else "no checkpoint was saved yet")
        return (f"{nonfinite.limit} updates in a row had a non-finite loss or gradient (by step {step}; "
                f"training.max_nonfinite_steps={nonfinite.limit}); each was skipped, none reached the weights; "
                f"{last}: lower optimizer.lr or check the data, then resume")
    if stalled.reached(ongoing=True):
        n = stalled.current()
        since, saved = step - n + 1, run.saved_step
        held = ("no checkpoint was saved yet" if saved is None else
                f"the checkpoint at step {saved} in {cfg.checkpoint.dir} holds it" if saved >= since - 1 else
                f"the last checkpoint (step {saved}) was saved before it")
        return (f"the gradient has been exactly zero for the {n} updates since step {since} "
                f"(training.max_zero_grad_steps={stalled.limit}): the head saturated and no longer learns "
                f"(optimizer.lr={cfg.optimizer.lr:g}); {held}: start again from an earlier checkpoint or from "
                f"scratch with a lower optimizer.lr")
    return None


def peak_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` for MFU (None: unknown device, MFU not reported)."""
    found = step_lib.peak_tflops(getattr(device, "device_kind", ""))
    return None if found is None else found[0] * 1e12


def head_config(cfg, target_cfg):
    """The EAGLE3 head a run config asks for (before a checkpoint or init_from may replace it)."""
    aux = cfg.head.aux_layer_ids
    if aux is not None and max(aux) >= target_cfg.num_layers:
        raise Stop(2, f"error: head.aux_layer_ids {list(aux)}: the target has layers 0..{target_cfg.num_layers - 1}")
    return Eagle3Config.from_target(target_cfg, draft_vocab_size=cfg.head.draft_vocab_size,
                                    num_layers=cfg.head.num_layers, aux_layer_ids=aux, dtype=cfg.head.dtype)


def make_optimizer(cfg, total_steps: int):
    return step_lib.make_optimizer(
        lr=cfg.optimizer.lr, total_steps=total_steps, warmup_ratio=cfg.optimizer.warmup_ratio,
        min_lr_ratio=cfg.optimizer.min_lr_ratio, weight_decay=cfg.optimizer.weight_decay, b1=cfg.optimizer.b1,
        b2=cfg.optimizer.b2, clip_norm=cfg.optimizer.clip_norm, grad_accum=cfg.training.grad_accum)


class Stop(Exception):
    """Setup cannot go on: ``lines`` say why (and what to do), ``code`` is the exit status."""

    def __init__(self, code: int, *lines: str):
        super().__init__(lines[0] if lines else "")
        self.code, self.lines = code, lines


@dataclasses.dataclass
class Run:
    """Everything the training loop needs, built by :func:`setup`."""
    cfg: RunConfig
    log: Logger
    model_dir: str
    target_cfg: ModelConfig
    target_arg: Any  # the target's params, or only its embeddings when training from the offline cache
    offline_train: bool
    batches: data_lib.BatchIterator
    eval_batches: Callable[[], data_lib.BatchIterator | None]
    total_steps: int
    ckpt: ckpt_lib.Checkpointer
    head_cfg: Any
    state: step_lib.TrainState
    vocab_map: Any
    vocab_source: str
    train_step: Callable
    eval_step: Callable
    saved_step: int | None = None

    def meta(self) -> dict:
        return {"run_config": self.cfg.to_dict(), "head_config": ckpt_lib.head_config_to_dict(self.head_cfg),
                "target_model_path": target_path(self.model_dir),
                "data_state": self.batches.state_dict(), "total_steps": self.total_steps,
                "vocab_source": self.vocab_source}

    def save(self, step: int, wait: bool = False) -> None:
        if self.saved_step == step:
            return
        self.saved_step = step
        st = self.state
        self.ckpt.save(step, params=st.params, train={"opt_state": st.opt_state, "step": st.step, "rng": st.rng},
                       vocab=self.vocab_map, meta=self.meta(), wait=wait)

    def evaluate(self) -> dict:
        """Metrics over ``logging.eval_batches`` batches of the held-out split ({} when it is empty), pooled by
        their tokens (``loss.pool_metrics``); the batches are a fixed sample across the length buckets, the same at
        every eval."""
        ev = self.eval_batches()
        if ev is None:
            return {}
        batches = []
        for _ in range(min(self.cfg.logging.eval_batches, ev.steps_per_epoch)):
            batch, _ = next(ev)
            batches.append(jax.device_get(self.eval_step(self.state.params, self.target_arg, self.vocab_map, batch)))
        return {f"eval_{k}": v for k, v in loss_lib.pool_metrics(batches).items()}


def main(argv=None) -> int:
    if (got := config_from_command_line(build_parser(), sys.argv[1:] if argv is None else argv)) is None:
        return 2
    cfg = got[1]
    enable_compilation_cache()  # a restarted run (preemption, resume) loads its compiled steps
    try:
        init_distributed(cfg.multihost)
    except (ValueError, RuntimeError) as e:  # e.g. multihost.auto off a TPU pod: jax finds no coordinator
        print(f"error: multihost: jax.distributed.initialize() failed: {e}", flush=True)
        return 2
    reuse_cpu_temps()  # on a CPU: the steps' temporaries stay mapped from one step to the next
    primary = jax.process_index() == 0
    made = ckpt_lib.first_missing_dir(cfg.checkpoint.dir) if primary else None
    try:
        check_processes_agree(cfg)
        log = Logger(cfg, primary)
        run = setup(cfg, log)
    except (Stop, OSError, ShardingError) as e:  # the user's to fix: said in a line, no empty checkpoint folder left
        # on every process: a cause that only one host meets (its own data path, disk) is in that host's log
        who = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
        print("\n".join(who + line for line in (e.lines if isinstance(e, Stop) else
                                                 [f"error: {error_text(e)}"])), flush=True)
        ckpt_lib.remove_if_no_files(made)
        return e.code if isinstance(e, Stop) else 2
    if run is None:  # offline.build: the cache is written (and no checkpoint folder is left empty)
        ckpt_lib.remove_if_no_files(made)
        return 0
    return train(run)


# ---- setup ---------------------------------------------------------------------------------------------------------
def setup(cfg: RunConfig, log: Logger) -> Run | None:
    """Mesh -> target (sharded) -> data -> checkpoints, vocab map and train state -> jitted steps. Returns None when
    the run only builds the offline feature cache; raises :class:`Stop` on anything the user must fix."""
    mesh = make_run_mesh(cfg, log)
    model_dir, target_cfg, target_params = load_target(cfg, mesh, log)
    offline_train = cfg.offline.dir is not None and not cfg.offline.build
    try:
        tokenizer = data_lib.load_tokenizer(cfg.model.tokenizer or model_dir)
    except (ValueError, OSError) as e:
        raise Stop(2, f"error: no tokenizer in {cfg.model.tokenizer or model_dir} (model.tokenizer / model.path): "
                      f"{e}") from None
    try:
        full = data_lib.load_dataset(cfg.data, tokenizer, log=log.info)
    except data_lib.NoUsableData as e:
        raise Stop(2, f"error: {e}") from None
    try:
        train_data, eval_data = data_lib.train_and_eval(cfg.data, full, tokenizer, cfg.training.seed, log=log.info)
    except data_lib.NoUsableData as e:
        raise Stop(2, f"error: data.eval_paths: {e}") from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    head_cfg = head_config(cfg, target_cfg)
    if cfg.offline.build:
        offline_lib.build_cache(cfg.offline.dir, full, target_cfg, head_cfg, target_params, mesh,
                                fingerprint=data_lib.fingerprint(cfg.data, tokenizer),
                                target_fp=target_identity(cfg, model_dir),
                                batch_size=cfg.training.batch_size, buckets=cfg.data.buckets,
                                max_length=cfg.data.max_length, pad_id=pad_id, log=log.info)
        return None
    features = None
    if offline_train:
        try:
            features = offline_lib.FeatureCache(cfg.offline.dir, expect_tokens=len(full.tokens),
                                                expect_fingerprint=data_lib.fingerprint(cfg.data, tokenizer),
                                                expect_aux_layers=head_cfg.aux_layer_ids,
                                                expect_target=(target_identity(cfg, model_dir),
                                                               target_cfg.hidden_size, target_cfg.dtype))
        except (ValueError, FileNotFoundError) as e:
            raise Stop(2, f"error: offline.dir: {e}") from None
    it_kw = dict(batch_size=cfg.training.batch_size, grad_accum=cfg.training.grad_accum, buckets=cfg.data.buckets,
                 max_length=cfg.data.max_length, seed=cfg.training.seed, sharding=NamedSharding(mesh, P(None, "dp")),
                 pad_id=pad_id)
    batches = data_lib.BatchIterator(train_data, features=features, **it_kw)
    total_steps = cfg.training.max_steps or cfg.training.epochs * batches.steps_per_epoch
    log.info(f"train: {len(train_data)} conversations, {batches.steps_per_epoch} steps/epoch "
             f"({cfg.training.grad_accum} x {cfg.training.batch_size} sequences/step), {total_steps} steps; "
             f"eval: {len(eval_data)} conversations")

    def eval_batches():
        # shuffled by the run's seed, epoch 0: the first eval_batches batches sample every length bucket (in bucket
        # order they were the shortest conversations only), and every eval reads the same ones
        return data_lib.BatchIterator(eval_data, shuffle=True, features=features, **it_kw) if len(eval_data) else None

    ckpt = ckpt_lib.Checkpointer(cfg.checkpoint.dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    optimizer = make_optimizer(cfg, total_steps)
    try:
        head_cfg, state, vocab_map, vocab_source, resume_step = init_head(
            cfg, log, ckpt, optimizer, mesh, (model_dir, target_cfg, target_params), head_cfg, train_data, batches)
    except Stop:
        ckpt.close()  # now, not at interpreter exit (orbax's background threads would report errors then)
        raise
    make = step_lib.make_train_step_offline if offline_train else step_lib.make_train_step
    train_step = make(target_cfg, head_cfg, optimizer, mesh, ttt_length=cfg.training.ttt_length,
                      decay=cfg.training.decay, grad_accum=cfg.training.grad_accum)
    eval_step = step_lib.make_eval_step(target_cfg, head_cfg, mesh, ttt_length=cfg.training.ttt_length,
                                        decay=cfg.training.decay, offline=offline_train)
    return Run(cfg=cfg, log=log, model_dir=model_dir, target_cfg=target_cfg, target_arg=target_params,
               offline_train=offline_train, batches=batches, eval_batches=eval_batches, total_steps=total_steps,
               ckpt=ckpt, head_cfg=head_cfg, state=state, vocab_map=vocab_map, vocab_source=vocab_source,
               train_step=train_step, eval_step=eval_step, saved_step=resume_step)


def make_run_mesh(cfg: RunConfig, log: Logger):
    tp, n = cfg.mesh.tp, jax.device_count()
    dp = cfg.mesh.dp if cfg.mesh.dp > 0 else n // tp
    if dp * tp > n or dp < 1:
        raise Stop(2, f"error: mesh.dp x mesh.tp = {cfg.mesh.dp} x {tp} needs more than the {n} "
                      f"{jax.devices()[0].platform} device(s) here")
    mesh = make_mesh(dp=dp, tp=tp)
    if cfg.training.batch_size % dp:
        raise Stop(2, f"error: training.batch_size={cfg.training.batch_size} must be divisible by mesh.dp={dp}")
    log.info(f"mesh dp={dp} tp={tp} on {jax.device_count()} {jax.devices()[0].platform} devices, "
             f"{jax.process_count()} process(es)")
    return mesh


def target_identity(cfg: RunConfig, model_dir: str) -> str:
    """What an offline cache records of the target that built it: its weights' fingerprint, or the seed of random
    ones (``model.random_init``)."""
    return f"random-init-{cfg.training.seed}" if cfg.model.random_init else offline_lib.target_fingerprint(model_dir)


def load_target(cfg: RunConfig, mesh, log: Logger):
    """(model folder, ModelConfig, params): the full target, only its embeddings (training from the offline cache),
    or random weights (``model.random_init``), sharded over the mesh."""
    if not cfg.model.path:
        raise Stop(2, "error: model.path is not set: give the target's folder or hub id (--model.path PATH, or "
                      "model: {path: ...} in the config)")
    try:
        model_dir = weights.resolve_model_path(cfg.model.path)
        target_cfg = ModelConfig.from_pretrained(model_dir, dtype=cfg.model.dtype)
    except Exception as e:  # noqa: BLE001 - the message says what to do
        lines = [f"error: cannot use model.path={cfg.model.path!r}: {e}"]
        if "smollm2" in (cfg.model.path or "").lower():
            lines.append("fetch it with:  python -m specjax.convert fetch-smollm2   (into $SPECJAX_CACHE or "
                         "~/.cache/specjax; point --model.path at the folder it prints)")
        raise Stop(2, *lines) from None
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
    if not offline_train:
        target_params = target_lib.stacked_bits(target_params, target_cfg)  # a CPU's faster layer scan
    log.info(f"target {target_cfg.architecture} ({target_cfg.num_params() / 1e6:.0f}M params, {target_cfg.dtype}) "
             f"from {model_dir}")
    return model_dir, target_cfg, target_params


def init_head(cfg, log, ckpt, optimizer, mesh, target, head_cfg, train_data, batches):
    """(head config, train state, vocab map, where the map came from, resumed step or None): restored from the
    newest good checkpoint, else fresh (from ``head.init_from``, ``head.vocab_map`` or the training data).
    ``target``: (model folder, ModelConfig, params), as ``load_target`` returns them."""
    model_dir, target_cfg, target_params = target
    if not cfg.checkpoint.resume and (earlier := ckpt.valid_steps()):
        raise Stop(2, f"error: {cfg.checkpoint.dir} holds steps {earlier} of an earlier run and checkpoint.resume is "
                      f"false: this run's saves would delete them (checkpoint.keep {cfg.checkpoint.keep}); give it "
                      f"its own checkpoint.dir, or remove those steps")
    resume_step = ckpt.latest_step() if cfg.checkpoint.resume else None
    if cfg.checkpoint.resume and resume_step is None and (damaged := ckpt.damaged_steps_seen()):
        raise Stop(1, f"error: {cfg.checkpoint.dir} holds no usable checkpoint, only damaged ones moved aside "
                      f"({', '.join(damaged)}); {FRESH_HINT}")
    rep = NamedSharding(mesh, P())
    if resume_step is not None:
        head_cfg, state, vocab_map, resume_step = resume(cfg, log, ckpt, optimizer, mesh, model_dir, target_cfg,
                                                         head_cfg, batches)
        vocab_source = f"checkpoint step {resume_step}"
    else:
        head_cfg, init_params, vocab_map, vocab_source = fresh_head(cfg, target_cfg, head_cfg, train_data)
        if init_params is not None:  # host copies -> replicated global arrays (any number of processes)
            init_params = jax.tree.map(lambda x: jax.make_array_from_callback(
                x.shape, rep, lambda idx, x=np.asarray(jax.device_get(x)): x[idx]), init_params)
        if cfg.head.widen_vocab:
            head_cfg, init_params, vocab_map, grown = widen_head(cfg.head, head_cfg, init_params, vocab_map,
                                                                  train_data, target_params)
            vocab_source += grown
        if init_params is None and cfg.head.init_lm_head == "target":
            init_params = eagle3.init_params_from_target(
                head_cfg.replace(dtype="float32"), jax.random.PRNGKey(cfg.training.seed), target_params.embed,
                target_params.lm_head, getattr(target_params, "final_norm", None), vocab_map)
            vocab_source += "; lm_head and norm from the target"
        state = step_lib.init_train_state(head_cfg, cfg.training.seed, optimizer, mesh, init_params=init_params)
    vocab_map = jax.device_put(vocab_map, rep)
    log.info(f"head: {head_cfg.num_layers} layer(s), hidden {head_cfg.hidden_size}, draft vocab "
             f"{head_cfg.draft_vocab_size} ({vocab_source}), aux layers {list(head_cfg.aux_layer_ids)}")
    return head_cfg, state, vocab_map, vocab_source, resume_step


FRESH_HINT = "to start from scratch anyway pass --checkpoint.resume false"


def resume(cfg, log, ckpt, optimizer, mesh, model_dir, target_cfg, head_cfg, batches):
    """The newest checkpoint step that passes its checksums and loads (damaged ones are moved aside); the data
    iterator continues where it was."""
    rep = NamedSharding(mesh, P())

    def resume_abstract(meta):  # the run's head, as saved in the step being restored
        hc = ckpt_lib.head_config_from_dict(meta["head_config"]).replace(dtype=head_cfg.dtype)
        check_resumable(hc, head_cfg, meta.get("target_model_path"), target_path(model_dir), log.info)
        st = step_lib.abstract_train_state(hc, optimizer, mesh)
        return {"params": st.params, "train": {"opt_state": st.opt_state, "step": st.step, "rng": st.rng},
                "vocab": {"d2t": jax.ShapeDtypeStruct((hc.draft_vocab_size,), np.int32, sharding=rep),
                          "t2d": jax.ShapeDtypeStruct((target_cfg.vocab_size,), np.bool_, sharding=rep)}}
    try:
        resume_step, out = ckpt.restore(abstract=resume_abstract)
    except ckpt_lib.CheckpointMismatch as e:
        raise Stop(2, f"error: {e}; give this run its own checkpoint.dir") from None
    except ckpt_lib.CheckpointError as e:
        raise Stop(1, f"error: {e}; {FRESH_HINT}") from None
    head_cfg = ckpt_lib.head_config_from_dict(out["meta"]["head_config"]).replace(dtype=head_cfg.dtype)
    state = step_lib.TrainState(params=out["params"], opt_state=out["train"]["opt_state"],
                                step=out["train"]["step"], rng=out["train"]["rng"])
    vocab_map = VocabMap(d2t=out["vocab"]["d2t"], t2d=out["vocab"]["t2d"])
    batches.load_state_dict(out["meta"]["data_state"])
    log.info(f"resumed from {cfg.checkpoint.dir} step {resume_step} (data epoch {batches.epoch}, "
             f"batch {batches.position})")
    if changed := changed_settings(out["meta"].get("run_config") or {}, cfg.to_dict()):
        log.info(f"note: this run's settings differ from the checkpoint's run: {', '.join(changed)}; they apply from "
                 f"here on (the data position is the saved one, so other data or batch sizes do not continue its "
                 f"plan)")
    return head_cfg, state, vocab_map, resume_step


def changed_settings(saved: dict, now: dict) -> list[str]:
    """``key NEW (was OLD)`` for each of the run's settings (:func:`run_settings`) whose value differs from the saved
    run's."""
    was = run_settings(saved)
    return [f"{k} {v} (was {was[k]})" for k, v in run_settings(now).items() if k in was and was[k] != v]


def check_resumable(saved: Eagle3Config, asked: Eagle3Config, saved_target: str | None, target: str, note) -> None:
    """A checkpoint's head must fit the target of this run (CheckpointMismatch: another target's checkpoint,
    which must not be taken for a damaged one); head settings that differ from the config are said, since the
    checkpoint's win."""
    for name in ("vocab_size", "target_hidden_size"):
        if getattr(saved, name) != getattr(asked, name):
            raise ckpt_lib.CheckpointMismatch(
                f"the checkpoint's head was trained for a target with {name} {getattr(saved, name)}, this run's "
                f"target ({target}) has {getattr(asked, name)}")
    kept = [f"{n} {getattr(saved, n)} (config: {getattr(asked, n)})" for n in ("draft_vocab_size", "num_layers",
            "aux_layer_ids") if getattr(saved, n) != getattr(asked, n)]
    if kept:
        note("note: resuming keeps the checkpoint's head: " + ", ".join(kept))
    if saved_target and saved_target != target:
        note(f"note: the checkpoint was trained against {saved_target}; this run's target is {target}")


def target_path(model_dir: str) -> str:
    """How a checkpoint names its target: the model folder's absolute path (a hub id as it is)."""
    return os.path.abspath(model_dir) if os.path.isdir(model_dir) else model_dir


def fresh_head(cfg, target_cfg, head_cfg, train_data):
    """(head config, initial params or None, vocab map, where the map came from) for a run with no checkpoint."""
    if cfg.head.init_from:
        try:
            head0, init_params, vocab_map = load_init_head(cfg.head.init_from, target_cfg)
        except (ckpt_lib.CheckpointError, HeadFormatError, ValueError) as e:
            raise Stop(2, f"error: head.init_from: {e}") from None
        if (head0.vocab_size, head0.target_hidden_size) != (target_cfg.vocab_size, target_cfg.hidden_size):
            raise Stop(2, f"error: head.init_from={cfg.head.init_from} was trained for a target with vocab "
                          f"{head0.vocab_size} and hidden {head0.target_hidden_size}, not this one "
                          f"({target_cfg.vocab_size}, {target_cfg.hidden_size})")
        # the head keeps its own shape, aux layers and vocab map
        return head0.replace(dtype=head_cfg.dtype), init_params, vocab_map, f"head {cfg.head.init_from}"
    if cfg.head.vocab_map:
        try:
            vocab_map = load_vocab_map(cfg.head.vocab_map)
        except ValueError as e:
            raise Stop(2, f"error: head.vocab_map: {e}") from None
        if len(vocab_map.t2d) != target_cfg.vocab_size:
            raise Stop(2, f"error: head.vocab_map={cfg.head.vocab_map} maps a vocab of {len(vocab_map.t2d)} ids, the "
                          f"target has {target_cfg.vocab_size}")
        return head_cfg.replace(draft_vocab_size=len(vocab_map.d2t)), None, vocab_map, cfg.head.vocab_map
    counts = count_tokens(train_data.tokens, train_data.loss_mask, target_cfg.vocab_size)
    vocab_map = build_vocab_map(counts, head_cfg.draft_vocab_size)
    return head_cfg, None, vocab_map, f"counted over {int(counts.sum())} training tokens"


def load_init_head(path: str, target_cfg):
    """(head config, fp32 params, vocab map) of ``head.init_from``: a specjax checkpoint, or an HF EAGLE3 head folder
    (a published or SpecForge-trained head, as ``convert import-head`` reads it)."""
    if "://" not in path and not os.path.exists(path):
        raise ValueError(f"{path} does not exist (a specjax checkpoint folder or an HF EAGLE3 head folder)")
    if not is_hf_eagle3_head(path):
        return ckpt_lib.load_head_for_export(path)[:3]
    head0, params, vocab_map = load_eagle3_head(path, target_cfg, dtype="float32")
    return head0, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), vocab_map


def widen_head(head: HeadConfig, head_cfg, params, vocab_map, train_data, target_params):
    """``head.widen_vocab``: the init_from head grown to ``head.draft_vocab_size`` ids (``vocab.widen_vocab_map``;
    the ids added by the counts saved in ``head.vocab_map`` when given, else by the training split's; their lm_head
    rows by ``eagle3.widen_lm_head``). Returns (head config, params, vocab map, what was done)."""
    size, counted = head.draft_vocab_size, "the training tokens"
    try:
        if head.vocab_map:
            counts, counted = load_vocab_counts(head.vocab_map), f"the tokens counted in {head.vocab_map}"
            if len(counts) != head_cfg.vocab_size:
                raise ValueError(f"{head.vocab_map} counts {len(counts)} ids, the target has {head_cfg.vocab_size}")
        else:
            counts = count_tokens(train_data.tokens, train_data.loss_mask, head_cfg.vocab_size)
        vocab_map = jax.device_get(vocab_map)  # host arrays (the grown map is placed with the rest after this)
        grown = widen_vocab_map(vocab_map, counts, size)
    except ValueError as e:
        raise Stop(2, f"error: head.widen_vocab: {e}") from None
    ids = lambda vm: np.asarray(vm.draft_to_target(np.arange(len(vm.d2t))))  # sorted target ids, on the host
    rows = target_params.embed if target_params.lm_head is None else target_params.lm_head.T  # [V, Ht]
    lm_head = eagle3.widen_lm_head(params.lm_head, ids(vocab_map), ids(grown), rows)
    share = lambda vm: counts[np.asarray(vm.t2d)].sum() / max(1, counts.sum())
    note = (f"; grown from {len(vocab_map.d2t)} ids (covering {share(vocab_map):.2%} of {counted}) to "
            f"{size} ({share(grown):.2%}), the added lm_head rows mapped from the target's")
    return head_cfg.replace(draft_vocab_size=size), dataclasses.replace(params, lm_head=lm_head), grown, note


# ---- the loop --------------------------------------------------------------------------------------------------------
def train(run: Run) -> int:
    """Step until ``total_steps`` (or a signal): metrics every ``logging.every`` steps, evals, checkpoints; stop with
    status 1 when too many updates in a row were not finite or had a zero gradient. The last step is always saved."""
    cfg, log = run.cfg, run.log
    stop = watch_signals()
    step = int(jax.device_get(run.state.step))
    bar = log.progress(run.total_steps, step, cfg.logging.progress)
    meter = Throughput(run)
    nonfinite, stalled = Streak(cfg.training.max_nonfinite_steps), Streak(cfg.training.max_zero_grad_steps)
    while step < run.total_steps:
        batch, info = next(run.batches)
        run.state, metrics = run.train_step(run.state, run.target_arg, run.vocab_map, batch)
        step += 1
        nonfinite.add(metrics["skipped"])
        stalled.add(metrics["zero_grad"])
        meter.add(info)
        if step % cfg.logging.every == 0 or step == run.total_steps:
            log_metrics(run, step, metrics, info, meter.take(), nonfinite.total(), bar)
        if bar is not None:
            bar.update(1)
        if cfg.logging.eval_every and step % cfg.logging.eval_every == 0:
            log_eval(run, step)
        if (step % cfg.logging.every == 0 or step % cfg.checkpoint.every == 0 or step == run.total_steps) and \
                (err := stop_reason(run, nonfinite, stalled, step)):
            log.info(f"error: {err}")
            run.ckpt.close()
            log.close()
            return 1
        if step % cfg.checkpoint.every == 0 and step < run.total_steps:
            run.save(step)
        run.ckpt.poll()
        if should_stop(stop, step, cfg.logging.every, run.total_steps):
            got = f"signal {stop['signal']}" if stop["signal"] is not None else "another process got a signal"
            log.info(f"{got}: saving a checkpoint at step {step} and exiting")
            break
    run.save(step, wait=True)
    run.ckpt.close()
    exported = export_final_head(run) if step == run.total_steps else None
    log.close()
    what = (f"stopped at step {step} of {run.total_steps} (rerun the same command to go on)" if step < run.total_steps
            else f"done at step {step}")
    where = f"HF head (SGLang / vLLM) in {exported}" if exported else \
        f"export with: python -m specjax.convert export-head {cfg.checkpoint.dir} OUT_DIR"
    log.info(f"{what}; checkpoint in {cfg.checkpoint.dir}; {where}")
    return 0


def export_final_head(run: Run) -> str | None:
    """``checkpoint.export``: the final head written as an HF EAGLE3 folder in bf16 (what ``convert export-head``
    writes): every process gathers the params (a collective: a head split over tp spans hosts), process 0 writes
    (into a local temporary folder first, then copied, when ``checkpoint.dir`` is a gs:// URL). Returns the folder,
    or None when there is none (turned off, another process, or a failed export, which is said: the checkpoint
    stays)."""
    ck = run.cfg.checkpoint
    if not ck.export:
        return None
    params, vmap = multihost_utils.process_allgather((run.state.params, run.vocab_map), tiled=True)
    if jax.process_index() != 0:
        return None
    remote = "://" in ck.dir
    out = f"{ck.dir.rstrip('/')}/{ck.export}" if remote else os.path.join(ck.dir, ck.export)
    try:
        with tempfile.TemporaryDirectory(prefix="specjax-export-") as tmp:
            local = os.path.join(tmp, "hf") if remote else out
            export_head(params, run.head_cfg, vmap, local, run.target_cfg, dtype="bfloat16", log=run.log.info)
            if remote:
                ckpt_lib.upload_folder(local, out, HF_HEAD_FILES)
    except Exception as e:  # noqa: BLE001 -- the run is done and its checkpoint saved: an export failure is a note
        run.log.info(f"note: the final head was not exported to {out} ({type(e).__name__}: {e}); the checkpoint "
                     f"is whole: python -m specjax.convert export-head {ck.dir} OUT_DIR")
        return None
    return out


def watch_signals() -> dict:
    """SIGTERM (preemption) and SIGINT set ``stop["signal"]``; the loop saves and exits at the next step. A second
    signal exits at once (a save that cannot finish, e.g. on a folder other hosts do not share, would hold the
    first)."""
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
        # A second signal takes the default action, from the kernel: it ends the process even while the main thread
        # is stuck in a save or a collective (where no Python handler could run).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print(f"signal {signum}: stopping at the next step with a checkpoint (the same signal again exits at once, "
              f"without that checkpoint; the last complete one is kept)", flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def should_stop(stop: dict, step: int, every: int, total_steps: int) -> bool:
    flag = stop["signal"] is not None
    if jax.process_count() > 1:
        # every host must stop at the same step: agree on the flag, but only at logging steps (which sync
        # with the devices anyway) so that the host keeps running ahead of the devices in between
        if step % every and step < total_steps:
            return False
        flag = bool(np.asarray(multihost_utils.process_allgather(np.asarray(flag))).any())
    return flag


class Throughput:
    """Tokens and model FLOPs since the last metric line, for tokens/s and MFU."""

    def __init__(self, run: Run):
        self.run, self.peak, self.n_dev = run, peak_flops(jax.devices()[0]), jax.device_count()
        self.tokens, self.flops, self.start = 0, 0.0, time.perf_counter()

    def add(self, info: dict) -> None:
        r = self.run
        self.tokens += info["tokens"]
        self.flops += info["tokens"] * step_lib.estimate_flops_per_token(
            r.target_cfg, r.head_cfg, info["seq_len"], r.cfg.training.ttt_length, include_target=not r.offline_train)

    def take(self) -> dict:
        """{tokens_per_s, mfu (when the device's peak is known)} over the window, then a new window."""
        dt = max(time.perf_counter() - self.start, 1e-9)
        out = {"tokens_per_s": self.tokens / dt}
        if self.peak is not None:
            out["mfu"] = self.flops / dt / (self.peak * self.n_dev)
        self.tokens, self.flops, self.start = 0, 0.0, time.perf_counter()
        return out


def log_metrics(run: Run, step: int, metrics, info: dict, rates: dict, skipped_total: float, bar) -> None:
    log = run.log
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    m.update(epoch=run.batches.epoch, seq_len=info["seq_len"], tokens_per_s=rates["tokens_per_s"], time=time.time())
    if "mfu" in rates:
        m["mfu"] = rates["mfu"]
    m["skipped_total"] = skipped_total
    if m["skipped"]:
        log.info(f"warning: non-finite loss or gradient at step {step}; the update was skipped "
                 f"({m['skipped_total']:.0f} skipped so far)")
    log.metrics(step, m)
    if bar is not None:
        bar.set_postfix({"loss": f"{m['loss']:.3f}", "acc_0": f"{m.get('acc_0', float('nan')):.3f}",
                         "tok/s": f"{m['tokens_per_s']:.0f}", **({"mfu": f"{m['mfu']:.1%}"} if "mfu" in m else {})})
    elif log.primary:
        print(f"step {step}/{run.total_steps} loss {m['loss']:.4f} acc_0 {m.get('acc_0', float('nan')):.3f} "
              f"tok/s {m['tokens_per_s']:.0f}" + (f" mfu {m['mfu']:.1%}" if "mfu" in m else ""), flush=True)


def log_eval(run: Run, step: int) -> None:
    em = run.evaluate()
    if not em:
        return
    run.log.metrics(step, em)
    n = run.cfg.training.ttt_length
    accs = " ".join(f"{em[f'eval_acc_{k}']:.3f}" for k in range(n) if f"eval_acc_{k}" in em)
    run.log.info(f"eval at step {step}: loss {em['eval_loss']:.4f} acc_0..{n - 1} {accs} predicted chain accept "
                 f"length {em.get('eval_serving_accept_len', float('nan')):.2f} served "
                 f"({em.get('eval_accept_len', float('nan')):.2f} averaged over positions)")


if __name__ == "__main__":
    sys.exit(main())
