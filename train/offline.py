"""Offline mode: run the frozen target once over the dataset, cache what the head needs, train from the cache.

Per token the cache holds the target's aux features (3*D) and its final hidden state after the final norm (D);
the train step recomputes the logits with the target's lm_head (see ``make_train_step_offline`` in train_step.py for why
not logits). Files in the cache folder:
    aux.bin     [N, 3*D] target dtype, row n = token n of the tokenized dataset (its offsets give the examples)
    hidden.bin  [N, D]
    manifest.json  dims, dtype, N, the dataset's and the target's fingerprints; written last ("complete": true)
Features of a token depend only on its own sequence (causal attention, padding after it), so caching per example
is exact. Size: (k+1)*D*N values for k aux layers (Qwen2.5-7B, k=3: 28 KB per token in bf16); the space is reserved
before the first batch (a full disk is one line, not a bus error mid-build). Every host of a multi-host run needs
the folder (shared disk, or copy it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import weights
from specjax.safetensors_io import CheckpointIndex
from specjax.sharding import agree_on_error
from specjax.train import data as data_lib
from specjax.train.train_step import TargetEmbeddings, make_feature_fn


def _np_dtype(name: str):
    return np.dtype(jnp.dtype(name))


def target_fingerprint(model_dir: str) -> str:
    """A short hash of the target's weights that a cache must have been built with: the first 8 rows of every tensor
    of the checkpoint (read in place, a few KB per tensor). Another model of the same tokenizer and width, a
    fine-tune or a merged LoRA of it, gives another fingerprint."""
    ckpt = CheckpointIndex(model_dir)
    h = hashlib.sha256()
    for key in sorted(ckpt.keys()):
        h.update(key.encode() + np.ascontiguousarray(np.asarray(ckpt.tensor(key)[:8], np.float32)).tobytes())
    return h.hexdigest()[:16]


def _open_rows(path: str, dt, shape: tuple[int, int], folder: str) -> np.memmap:
    """A cache file read-only, refused in a line when it is shorter than the manifest says."""
    need = shape[0] * shape[1] * dt.itemsize
    have = os.path.getsize(path)
    if have < need:
        raise ValueError(f"offline cache {folder}: {os.path.basename(path)} holds {have} bytes, its manifest says "
                         f"{need} (a damaged or partly copied cache); rebuild it")
    return np.memmap(path, dt, "r", shape=shape)


def _reserve(path: str, dt, shape: tuple[int, int]) -> np.memmap:
    """A new cache file with its space reserved on disk now (posix_fallocate), written through a mapping: writing
    into a sparse mapping on a full disk kills the process with SIGBUS instead."""
    nbytes = shape[0] * shape[1] * dt.itemsize
    with open(path, "wb") as f:
        try:
            if not hasattr(os, "posix_fallocate"):  # macOS: no reservation, the file is sparse
                raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
            os.posix_fallocate(f.fileno(), 0, nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                f.close()
                os.remove(path)  # the part reserved is the space the message asks to free
                raise OSError(f"offline cache: {path} needs {nbytes / 1e9:.2f} GB and the disk has less free; free "
                              f"space or choose another offline.dir") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            f.truncate(nbytes)
    return np.memmap(path, dt, "r+", shape=shape)


class FeatureCache:
    """Read side: ``spec`` {name: (dim, dtype)} and ``rows(example) -> {"aux": [len, 3D], "target_hidden": [len, D]}``
    (the key names the offline train step expects)."""

    def __init__(self, folder: str, expect_fingerprint: str | None = None, expect_tokens: int | None = None,
                 expect_aux_layers: tuple[int, ...] | None = None, expect_target: tuple[str, int, str] | None = None):
        path = os.path.join(folder, "manifest.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no complete offline cache in {folder}; build it first with --offline.build true")
        with open(path) as f:
            self.manifest = json.load(f)
        m = self.manifest
        if expect_fingerprint is not None and m["fingerprint"] != expect_fingerprint:
            raise ValueError(f"offline cache {folder} was built from different data or tokenizer settings; rebuild it")
        if expect_tokens is not None and m["tokens"] != expect_tokens:
            raise ValueError(f"offline cache {folder} holds {m['tokens']} tokens, the dataset has {expect_tokens}")
        saved = m.get("aux_layer_ids")
        if expect_aux_layers is not None and saved is not None and list(saved) != list(expect_aux_layers):
            raise ValueError(f"offline cache {folder} holds the features of target layers {saved}, the head reads "
                             f"{list(expect_aux_layers)}; rebuild it or set head.aux_layer_ids to {saved}")
        if expect_target is not None:
            self._check_target(folder, *expect_target)
        dt = _np_dtype(m["dtype"])
        self.offsets = np.asarray(m["offsets"], np.int64)
        self.aux = _open_rows(os.path.join(folder, "aux.bin"), dt, (m["tokens"], m["aux_dim"]), folder)
        self.hidden = _open_rows(os.path.join(folder, "hidden.bin"), dt, (m["tokens"], m["hidden_dim"]), folder)
        self.spec = {"aux": (m["aux_dim"], dt), "target_hidden": (m["hidden_dim"], dt)}

    def _check_target(self, folder: str, fingerprint: str, hidden: int, dtype: str) -> None:
        """The cache must come from this run's target: its width, its weights (caches written before the target's
        fingerprint was recorded skip that check) and its dtype (features of a bf16 target are not an fp32 one's)."""
        m = self.manifest
        if m["hidden_dim"] != hidden:
            raise ValueError(f"offline cache {folder} holds features of width {m['hidden_dim']}, this run's target "
                             f"has hidden size {hidden}: it was built with another model; rebuild it")
        if m.get("target_fingerprint", fingerprint) != fingerprint:
            raise ValueError(f"offline cache {folder} was built with another target's weights (same width and "
                             f"tokenizer): rebuild it for model.path, or point model.path at the model that built it")
        if m["dtype"] != dtype:
            raise ValueError(f"offline cache {folder} was built with a {m['dtype']} target, this run's target is "
                             f"{dtype}: set model.dtype {m['dtype']}, or rebuild it")

    def rows(self, example: int) -> dict[str, np.ndarray]:
        a, b = self.offsets[example], self.offsets[example + 1]
        return {"aux": self.aux[a:b], "target_hidden": self.hidden[a:b]}


def build_cache(folder: str, data: data_lib.TokenizedData, target_cfg, head_cfg, target_params, mesh, *,
                fingerprint: str, target_fp: str, batch_size: int, buckets, max_length: int, pad_id: int = 0,
                log=print) -> None:
    """Run the target over every example of ``data`` (all of it: train and eval) and write the cache."""
    primary = jax.process_index() == 0
    n_tok = len(data.tokens)
    d = target_cfg.hidden_size
    aux_dim = len(head_cfg.aux_layer_ids) * d
    dt = _np_dtype(target_cfg.dtype)
    failed = None
    if primary:
        try:
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(os.path.join(folder, "manifest.json")):
                os.remove(os.path.join(folder, "manifest.json"))
            aux = _reserve(os.path.join(folder, "aux.bin"), dt, (max(n_tok, 1), aux_dim))
            hid = _reserve(os.path.join(folder, "hidden.bin"), dt, (max(n_tok, 1), d))
        except OSError as e:
            failed = e
    if err := agree_on_error(None if failed is None else str(failed)):  # the other processes must not wait
        raise failed if failed is not None else OSError(err)
    features = make_feature_fn(target_cfg, head_cfg, mesh)
    sharding = NamedSharding(mesh, P("dp"))
    it = data_lib.BatchIterator(data, batch_size=batch_size, grad_accum=1, buckets=buckets, max_length=max_length,
                                seed=0, shuffle=False, pad_id=pad_id)
    plan = it.plan(0)
    t0 = time.perf_counter()
    for i, pb in enumerate(plan):
        batch, _ = it.materialise(pb)  # host arrays [1, B, T]
        mine = data_lib.local_batch_rows(sharding, (batch_size, pb.seq_len), axis=0)
        ids, am = (jax.make_array_from_process_local_data(sharding, batch[k][0][mine], (batch_size, pb.seq_len))
                   for k in ("input_ids", "attention_mask"))
        out = features(target_params, ids, am)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            out = multihost_utils.process_allgather(out, tiled=True)
        out = jax.device_get(out)
        if primary:
            for r, ex in enumerate(pb.rows):
                if ex < 0:
                    continue
                a, b = data.offsets[ex], data.offsets[ex + 1]
                aux[a:b] = np.asarray(out["aux"][r, :b - a]).astype(dt)
                hid[a:b] = np.asarray(out["target_hidden"][r, :b - a]).astype(dt)
        if (i + 1) % 50 == 0 or i + 1 == len(plan):
            log(f"offline cache: {i + 1}/{len(plan)} batches ({time.perf_counter() - t0:.0f} s)")
    if primary:
        aux.flush()
        hid.flush()
        manifest = {"complete": True, "fingerprint": fingerprint, "tokens": n_tok, "aux_dim": aux_dim,
                    "hidden_dim": d, "dtype": target_cfg.dtype, "aux_layer_ids": list(head_cfg.aux_layer_ids),
                    "target_fingerprint": target_fp,
                    "offsets": data.offsets.tolist()}
        tmp = os.path.join(folder, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, os.path.join(folder, "manifest.json"))
        gb = (aux_dim + d) * n_tok * dt.itemsize / 1e9
        log(f"offline cache: {n_tok} tokens, {gb:.2f} GB in {folder}")


def load_target_embeddings(model_dir: str, target_cfg, mesh):
    """Only the embedding and lm_head of the target (what the offline step needs), sharded like the full load."""
    ckpt = CheckpointIndex(model_dir)
    prefix = "model." if "model.embed_tokens.weight" in ckpt else ""
    sh = weights.param_shardings(target_cfg, mesh)
    dt = _np_dtype(target_cfg.dtype)
    v, d = target_cfg.vocab_size, target_cfg.hidden_size

    def place(key, shape, sharding, transpose=False):
        read = (lambda idx: ckpt.tensor(key).T[idx]) if transpose else (lambda idx: ckpt.tensor(key)[idx])
        return jax.make_array_from_callback(shape, sharding, lambda idx: np.asarray(read(idx), dt))

    embed = place(f"{prefix}embed_tokens.weight", (v, d), sh.embed)
    lm_head = None if target_cfg.tie_word_embeddings else place("lm_head.weight", (d, v), sh.lm_head, True)
    return TargetEmbeddings(embed=embed, lm_head=lm_head)
