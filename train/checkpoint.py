"""Training checkpoints: orbax CheckpointManager (async saves, keep last K) plus a commit marker of our own.

One checkpoint = one step folder with four items:
  params  the head's params (what export needs)          train  opt_state, step, rng (key data)
  vocab   d2t / t2d of the draft vocab                    meta   JSON: run config, head config, target model
                                                                 path, data iterator state
After orbax has finalised a step, process 0 writes ``specjax_commit.json`` into it: a manifest of every file with
its size and SHA-256. A step without the marker, with a missing file or a file of the wrong size (a crash mid-write,
a truncated copy) is not valid and is never listed. Before a step is restored every file's content is hashed and
compared with the manifest, so bit rot, a bad copy or an edited file (same size, other bytes) is caught too, with a
message naming the file: ``restore`` then takes the previous valid step, and process 0 moves damaged ones aside
(``corrupt-<step>-<time>``) so that training can save that step number again. Markers written before checksums
existed (format 1) are checked by size only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from specjax.cli import nearest_existing
from specjax.sharding import agree_on_error
from specjax.models import eagle3
from specjax.models.eagle3 import Eagle3Config, VocabMap

COMMIT_FILE = "specjax_commit.json"
FORMAT_VERSION = 2  # 1: sizes only; 2: sizes and SHA-256
CORRUPT_PREFIX = "corrupt-"
INTERRUPTED_PREFIX = "interrupted-"  # a step whose save never finished: absent, not damaged
NO_MARKER = "no commit marker (interrupted save?)"
_HASH_CHUNK = 8 << 20
log = logging.getLogger("specjax.train.checkpoint")


class CheckpointMismatch(ValueError):
    """A valid checkpoint that belongs to another run (another target, say): said as is, never moved aside as
    damaged (``Checkpointer.restore`` raises it from its ``abstract`` callback at once)."""


class CheckpointError(RuntimeError):
    pass


def _sha256(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: epath.Path) -> dict[str, dict[str, Any]]:
    """Manifest of the step's files: relative path -> {size, sha256}."""
    out = {}
    stack = [step_dir]
    while stack:
        for p in stack.pop().iterdir():
            if p.is_dir():
                stack.append(p)
            elif not p.name.startswith(COMMIT_FILE):
                out[str(p.relative_to(step_dir))] = {"size": int(p.stat().length), "sha256": _sha256(p)}
    return out


def _step_dirs(root: epath.Path) -> dict[int, epath.Path]:
    out = {}
    if not root.exists():
        return out
    for p in root.iterdir():
        if p.is_dir() and p.name.isdigit():
            out[int(p.name)] = p
    return out


def validate_step_dir(step_dir: epath.Path, *, content: bool = False) -> str | None:
    """None if the step is complete, else the reason it is not. ``content``: also hash every file and compare
    with the manifest (reads the whole step; done before a restore)."""
    marker = step_dir / COMMIT_FILE
    if not marker.exists():
        return NO_MARKER
    try:
        manifest = json.loads(marker.read_text())["files"]
        entries = {rel: (e, None) if isinstance(e, int) else (int(e["size"]), str(e["sha256"]))
                   for rel, e in manifest.items()}
    except Exception as e:  # noqa: BLE001
        return f"unreadable commit marker ({type(e).__name__})"
    for rel, (size, digest) in entries.items():
        p = step_dir / rel
        if not p.exists():
            return f"missing file {rel}"
        got = int(p.stat().length)
        if got != size:
            return f"file {rel} has {got} bytes, expected {size}"
    if content:
        for rel, (_, digest) in entries.items():
            if digest is not None and _sha256(step_dir / rel) != digest:
                return f"file {rel} is damaged (its SHA-256 differs from the one recorded at save)"
    return None


def check_filesystem(path: str) -> None:
    """An OSError naming the missing package when ``path`` is on Cloud Storage and neither gcsfs nor TensorFlow
    (etils' two backends for gs://, which orbax's paths go through) is installed: said before the target and data
    load, not as an ImportError at the first save."""
    if str(path).startswith("gs://") and not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
        raise OSError(f"{path}: gs:// folders need the gcsfs package: pip install 'specjax[gcs]' (or pip install "
                      f"gcsfs)")


def checkpoint_root(directory: str) -> epath.Path:
    """The folder a run's checkpoints live in: absolute (orbax's tensorstore needs absolute local paths; gs:// and
    other URLs pass through unchanged), its filesystem checked (:func:`check_filesystem`)."""
    if "://" not in str(directory):
        directory = os.path.abspath(os.path.expanduser(str(directory)))
    check_filesystem(directory)
    return epath.Path(directory)


_OPENED: set[str] = set()  # folders open_shared_dir passed in this process (every process calls it alike)


def open_shared_dir(root: epath.Path) -> None:
    """Process 0 makes ``root`` and checks that it can write there, then every process checks that it sees the same
    folder (:func:`check_shared`); an OSError on every process when either fails. Once per folder and process: the
    trainer checks before the target loads, and its Checkpointer then finds the folder checked."""
    if str(root) in _OPENED and (jax.process_count() > 1 or root.exists()):  # hosts skip alike, no collective
        return
    failed = None
    if jax.process_index() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            check_writable(root)
        except OSError as e:
            failed = e
    if err := agree_on_error(None if failed is None else str(failed)):
        raise failed if failed is not None else OSError(err)
    _sync("specjax_ckpt_mkdir")
    check_shared(root)
    _OPENED.add(str(root))


def check_writable(root: epath.Path) -> None:
    """An OSError naming ``root`` unless a file can be written there now (permission bits pass root under a
    read-only mount, where orbax's first save would wait minutes for a folder it cannot make)."""
    probe = root / f".specjax-write-probe-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"cannot write checkpoints to {root}: {e.strerror or e}") from None


def check_shared(root: epath.Path) -> None:
    """With several processes: an OSError on every process unless all of them see one folder at ``root`` (orbax's
    saves coordinate through it; a folder local to each host made every process wait at the first save, silently and
    for ever). Process 0 writes a file named by a nonce it broadcasts; each process looks for it."""
    if jax.process_count() == 1:
        return
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.randint(1, 2**31 - 1))))
    probe = root / f".specjax-shared-probe-{nonce}"
    if jax.process_index() == 0:
        probe.write_text("")
    _sync("specjax_ckpt_shared_write")
    seen = np.asarray(multihost_utils.process_allgather(np.int32(probe.exists()))).reshape(-1)
    _sync("specjax_ckpt_shared_read")
    if jax.process_index() == 0:
        probe.unlink()
    blind = [i for i, v in enumerate(seen) if not v]
    if blind:
        raise OSError(f"checkpoint.dir {root} is not one folder that every process sees (process(es) {blind} do "
                      f"not see a file process 0 wrote there): use a gs:// bucket or a filesystem shared by all "
                      f"hosts")


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """Save / validate / restore training checkpoints under ``directory``."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        self.root = checkpoint_root(directory)
        self.read_only = read_only
        self.primary = jax.process_index() == 0 and not read_only
        self._pending: list[int] = []
        self.quarantined: list[int] = []  # steps this instance moved aside
        items = ("params", "train", "vocab", "meta")
        if read_only:  # export / inspection: change nothing on disk
            absl_log = logging.getLogger("absl")
            level = absl_log.level
            absl_log.setLevel(logging.ERROR)  # orbax warns that a read-only manager is read-only
            try:
                self.mgr = ocp.CheckpointManager(self.root, options=ocp.CheckpointManagerOptions(
                    read_only=True, create=False, save_interval_steps=0), item_names=items)
            finally:
                absl_log.setLevel(level)
            return
        open_shared_dir(self.root)
        self.quarantine_invalid()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                            cleanup_tmp_directories=True)  # half-written saves of a killed run
        self.mgr = ocp.CheckpointManager(self.root, options=opts, item_names=items)
        # orbax removes those in a background thread that its close() does not join; a run that stops right away
        # (a damaged directory, a bad flag) then exits under it and the thread prints a traceback. Wait for it
        # here: it only lists the directory. (A private method of orbax's manager: skipped if it is gone.)
        getattr(self.mgr, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    # ---- validity ---------------------------------------------------------------------------------------------
    def valid_steps(self) -> list[int]:
        return sorted(s for s, p in _step_dirs(self.root).items() if validate_step_dir(p) is None)

    def latest_step(self) -> int | None:
        steps = self.valid_steps()
        return steps[-1] if steps else None

    def quarantine_invalid(self) -> list[int]:
        """Move invalid step folders aside (process 0) so they are never restored nor block a new save."""
        bad = {s: r for s, p in _step_dirs(self.root).items() if (r := validate_step_dir(p)) is not None}
        for s, reason in sorted(bad.items()):
            self._move_aside(s, reason)
        _sync("specjax_ckpt_quarantine")
        if hasattr(self, "mgr"):
            self.mgr.reload()
        return sorted(bad)

    def _move_aside(self, step: int, reason: str) -> None:
        """Move a step folder aside: ``interrupted-`` for a save that never got its marker (a kill between orbax's
        end and the marker, one step later: as if never saved), ``corrupt-`` for a damaged one."""
        self.quarantined.append(step)
        if self.primary:
            interrupted = reason == NO_MARKER
            dst = self.root / f"{INTERRUPTED_PREFIX if interrupted else CORRUPT_PREFIX}{step}-{int(time.time() * 1000)}"
            what = "was not finished saving (the run stopped first); it is not used" if interrupted else \
                f"is invalid ({reason})"
            log.warning("checkpoint step %d %s; moved to %s", step, what, dst)
            print(f"checkpoint: step {step} {what}; moved aside to {dst.name}", flush=True)
            (self.root / str(step)).rename(dst)

    def damaged_steps_seen(self) -> list[str]:
        """Names of the folders moved aside as damaged (by this run or an earlier one)."""
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name.startswith(CORRUPT_PREFIX))

    def _commit(self, step: int) -> None:
        step_dir = self.root / str(step)
        if self.primary and step_dir.exists():
            tmp = step_dir / (COMMIT_FILE + ".tmp")
            tmp.write_text(json.dumps({"step": step, "format": FORMAT_VERSION, "time": time.time(),
                                       "files": _files(step_dir)}))
            tmp.rename(step_dir / COMMIT_FILE)

    def poll(self) -> None:
        """Write the commit markers of saves that have finished (cheap; call every step)."""
        if self._pending and not self.mgr.is_saving_in_progress():
            self.mgr.check_for_errors()
            for s in self._pending:
                self._commit(s)
            self._pending = []

    def wait(self) -> None:
        self.mgr.wait_until_finished()
        for s in self._pending:
            self._commit(s)
        self._pending = []

    # ---- save / restore ---------------------------------------------------------------------------------------
    def save(self, step: int, *, params, train: dict[str, Any], vocab: VocabMap, meta: dict[str, Any],
             wait: bool = False) -> None:
        self.wait()  # one save in flight at a time; commits the previous one
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            train=ocp.args.StandardSave(train),
            vocab=ocp.args.StandardSave({"d2t": vocab.d2t, "t2d": vocab.t2d}),
            meta=ocp.args.JsonSave(dict(meta, format=FORMAT_VERSION, step=int(step))),
        )
        self.mgr.save(int(step), args=args, force=True)
        self._pending.append(int(step))
        if wait:
            self.wait()

    def restore(self, step: int | None = None, *, params=None, train=None, vocab=None,
                abstract: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> tuple[int, dict[str, Any]]:
        """Restore the newest valid step (or ``step``). ``params`` / ``train`` / ``vocab``: abstract pytrees
        (``jax.ShapeDtypeStruct`` leaves carrying shardings) of the items wanted; items left None are skipped.
        ``abstract(meta) -> {"params"?, "train"?, "vocab"?}`` builds them from the step's own meta instead (the
        shapes depend on the head config saved there). Returns (step, {"params", "train", "vocab", "meta"}).

        Every file of a step is checked against its recorded SHA-256 first. A step that is damaged or fails to
        restore is moved aside (unless read-only) and the previous valid one is tried; with an explicit ``step``
        the error is raised instead. CheckpointError when no step can be restored."""
        steps = [step] if step is not None else self.valid_steps()[::-1]
        if not steps:
            bad = "; ".join(f"step {n}: {validate_step_dir(p)}" for n, p in sorted(_step_dirs(self.root).items()))
            raise CheckpointError(f"no valid checkpoint in {self.root}" + (f" ({bad})" if bad else ""))
        errors = []
        for s in steps:
            try:
                return s, self._restore_one(s, params, train, vocab, abstract)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - damaged data: the message says which step and why
                reason = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {str(e)[:200]}"
                errors.append(f"step {s}: {reason}")
                print(f"checkpoint: step {s} cannot be restored ({reason})"
                      + ("" if step is not None else "; trying an older one"), flush=True)
                if step is not None:
                    break
                if not self.read_only:
                    self._move_aside(s, reason)
                    _sync("specjax_ckpt_quarantine")
                    self.mgr.reload()
        raise CheckpointError(f"no checkpoint in {self.root} could be restored: " + "; ".join(errors))

    def _restore_one(self, s: int, params, train, vocab, abstract) -> dict[str, Any]:
        if (reason := validate_step_dir(self.root / str(s), content=True)) is not None:
            raise CheckpointError(reason)
        meta = self.mgr.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        wanted = dict(abstract(meta)) if abstract is not None else {"params": params, "train": train, "vocab": vocab}
        items = {k: ocp.args.StandardRestore(v) for k, v in wanted.items() if v is not None}
        if not items:
            return {"meta": meta}
        out = self.mgr.restore(s, args=ocp.args.Composite(**items))
        return {"meta": meta, **{k: out[k] for k in items}}

    def close(self) -> None:
        self.wait()
        self.mgr.close()


# ---- head config, export ---------------------------------------------------------------------------------------
def first_missing_dir(path: str) -> str | None:
    """The outermost folder of ``path`` (a local path) that does not exist yet: what a run that fails before its
    first checkpoint should remove again (see :func:`remove_if_no_files`). None when ``path`` exists or is remote."""
    if "://" in path:
        return None
    path, there = os.path.abspath(path), nearest_existing(path)
    return None if path == there else os.path.join(there, os.path.relpath(path, there).split(os.sep)[0])


def remove_if_no_files(top: str | None) -> None:
    """Remove the folder tree ``top`` if it holds folders only (a run that stopped before writing anything)."""
    if top and os.path.isdir(top) and not any(files for _, _, files in os.walk(top)):
        for root, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            os.rmdir(root)


def upload_folder(local_dir: str, url: str, names: tuple[str, ...]) -> None:
    """Copy the files ``names`` of ``local_dir`` into ``url`` (a gs:// folder, or any path etils reads), in order:
    the last one (an HF folder's config.json, which says the folder is whole) is removed first and written last, so
    a reader never takes a half-copied folder for a complete one. Other files in ``url`` are left alone."""
    dst = epath.Path(url)
    dst.mkdir(parents=True, exist_ok=True)
    last = dst / names[-1]
    if last.exists():
        last.unlink()
    for name in names:
        (dst / name).write_bytes(epath.Path(local_dir, name).read_bytes())


def head_config_to_dict(cfg: Eagle3Config) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = [list(kv) for kv in cfg.rope_scaling] if cfg.rope_scaling is not None else None
    d["aux_layer_ids"] = list(cfg.aux_layer_ids)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def head_config_from_dict(d: dict[str, Any]) -> Eagle3Config:
    d = dict(d)
    d["rope_scaling"] = tuple((k, v) for k, v in d["rope_scaling"]) if d.get("rope_scaling") else None
    d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    names = {f.name for f in dataclasses.fields(Eagle3Config)}
    return Eagle3Config(**{k: v for k, v in d.items() if k in names})


def _single_device(tree):
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), tree)


def _resolve_dir(ckpt_dir: str) -> tuple[str, int | None]:
    """A manager root -> (root, None); a step folder inside one -> (root, step)."""
    check_filesystem(ckpt_dir)
    p = epath.Path(ckpt_dir)
    if p.name.isdigit() and ((p / COMMIT_FILE).exists() or (p / "meta").exists()):
        return str(p.parent), int(p.name)
    return str(p), None


def load_head_for_export(ckpt_dir: str) -> tuple[Eagle3Config, eagle3.Eagle3Params, VocabMap, str]:
    """(head_cfg, head_params, vocab_map, target_model_path) of the newest valid checkpoint under ``ckpt_dir``
    (a training checkpoint folder or one step folder in it), on the first local device; params in fp32."""
    head_cfg, params, vm, meta = load_head_checkpoint(ckpt_dir)
    return head_cfg, params, vm, meta.get("target_model_path", "")


def load_head_checkpoint(ckpt_dir: str) -> tuple[Eagle3Config, eagle3.Eagle3Params, VocabMap, dict[str, Any]]:
    """``load_head_for_export`` with the step's whole ``meta`` in place of its target path (``export-head`` also
    reads the ``source_dtype`` that ``import-head`` records)."""
    root, step = _resolve_dir(ckpt_dir)
    if not epath.Path(root).exists():
        raise CheckpointError(f"checkpoint folder {root} does not exist")
    ck = Checkpointer(root, read_only=True)

    def abstract(meta):
        head_cfg = head_config_from_dict(meta["head_config"])
        # fp32, as the train state keeps its master weights
        params = _single_device(jax.tree.map(lambda sd: jax.ShapeDtypeStruct(sd.shape, jnp.float32),
                                             eagle3.param_shapes(head_cfg)))
        vocab = _single_device({"d2t": jax.ShapeDtypeStruct((head_cfg.draft_vocab_size,), jnp.int32),
                                "t2d": jax.ShapeDtypeStruct((head_cfg.vocab_size,), jnp.bool_)})
        return {"params": params, "vocab": vocab}

    try:
        if step is not None and (reason := validate_step_dir(ck.root / str(step))) is not None:
            raise CheckpointError(f"checkpoint {ckpt_dir} is not valid: {reason}")
        got, out = ck.restore(step, abstract=abstract)
    finally:
        ck.mgr.close()
    skipped = sorted((n, p) for n, p in _step_dirs(ck.root).items() if n > got)
    if skipped:  # an older step than the folder's newest: say so, and why
        # (a step whose files were hashed and failed was already said by restore: no second read of it here)
        why = "; ".join(f"{n}: {validate_step_dir(p) or 'could not be restored'}" for n, p in skipped)
        print(f"checkpoint: loading step {got} of {ck.root}; newer step(s) skipped: {why}", file=sys.stderr,
              flush=True)
    head_cfg = head_config_from_dict(out["meta"]["head_config"])
    vm = VocabMap(d2t=out["vocab"]["d2t"], t2d=out["vocab"]["t2d"])
    return head_cfg, out["params"], vm, out["meta"]


__all__ = ["Checkpointer", "CheckpointError", "load_head_for_export", "load_head_checkpoint", "validate_step_dir",
           "head_config_to_dict", "head_config_from_dict"]
