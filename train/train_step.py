"""Train state, optimizer and the ONE jitted EAGLE3 train step (frozen target + TTT loss + AdamW update).

    optimizer = make_optimizer(lr=8e-4, total_steps=N, warmup_ratio=0.03)
    state = init_train_state(head_cfg, jax.random.PRNGKey(seed), optimizer, mesh)
    step = make_train_step(target_cfg, head_cfg, optimizer, mesh, ttt_length=7, decay=0.8, grad_accum=A)
    state, metrics = step(state, target_params, vocab_map, batch)   # batch leaves i32[A, B, T]

One call = A micro-batches (a ``lax.scan`` inside the jit) and one optimizer update. Per micro-batch the target
runs frozen (its aux features at ``head_cfg.aux_layer_ids`` and logits at every position, under stop_gradient),
then the head's TTT loss (train/loss.py) is differentiated. Gradients are averaged over micro-batches; since
every micro-batch's loss is a mean over its B*T positions, A micro-batches of B equal one batch of A*B exactly.

Sharding on a (dp, tp) mesh: batch over dp; the target tensor-parallel over tp (specjax.weights.param_shardings);
the head tensor-parallel over tp as well by default (``head_sharding="tp"``: attention heads, MLP width and the
draft vocab split Megatron-style, fc and norms replicated). A replicated head would make every tp rank repeat the
whole head computation on the same data (the head's 7-step rollout costs about as many FLOPs as the target's
forward) and keep tp copies of the fp32 master weights and Adam moments; sharding it removes both at the cost of
two all-reduces per layer per step. For the Qwen2.5-7B recipe (tests/test_aot_7b.py: 4x4 mesh, B=4 x T=1024 x A=4,
32K draft vocab) the compiled step needs 17.9 GiB per device with the head sharded and 36.0 GiB replicated, which
would not fit a TPU v4's 32 GiB. ``head_sharding="replicated"`` is available. Dimensions that do not divide by tp
fall back to replication.

Precision: master weights (``TrainState.params``) are fp32; the head computes in ``compute_dtype`` (default
``head_cfg.dtype``, e.g. bfloat16), attention softmax and logits in fp32, gradients and Adam in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from specjax import weights
from specjax.config import ModelConfig
from specjax.models import eagle3, target
from specjax.models.eagle3 import Eagle3Config, Eagle3Params, HeadLayerParams, VocabMap
from specjax.sharding import DEFAULT_RULES, spec_for_shape, use_mesh
from specjax.train import loss as ttt


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a training run carries from step to step (and checkpoints)."""
    params: Eagle3Params  # fp32 master weights of the head
    opt_state: Any  # optax state of ``make_optimizer``'s transformation
    step: jax.Array  # i32[] optimizer updates done so far
    rng: jax.Array  # u32[2] raw PRNG key, split once per step (reserved for stochastic extensions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetEmbeddings:
    """The only target weights the offline step needs: the embedding (head inputs) and the lm_head (logits)."""
    embed: jax.Array  # [V, D]
    lm_head: jax.Array | None  # [D, V]; None when tied to embed
    embed_panels: None = None  # never packed (target.compute_logits reads the table itself, as for TargetParams)


def target_embeddings(params: target.TargetParams) -> TargetEmbeddings:
    return TargetEmbeddings(embed=params.embed, lm_head=params.lm_head)


# ---- optimizer -----------------------------------------------------------------------------------------------------
def lr_schedule(lr: float, total_steps: int, warmup_ratio: float = 0.03, min_lr_ratio: float = 0.0):
    """Linear warmup from 0 over ``round(warmup_ratio * total_steps)`` updates, then cosine to ``lr * min_lr_ratio``
    at ``total_steps``."""
    total_steps = max(int(total_steps), 1)
    warmup = min(int(round(warmup_ratio * total_steps)), total_steps - 1)
    cosine = optax.cosine_decay_schedule(lr, max(total_steps - warmup, 1), alpha=min_lr_ratio)
    if warmup <= 0:
        return cosine
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), cosine], [warmup])


def _decay_mask(params):
    """Weight decay on matrices only (not on norm gains)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(lr: float = 8e-4, total_steps: int = 1000, warmup_ratio: float = 0.03, min_lr_ratio: float = 0.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.95, clip_norm: float = 0.5,
                   grad_accum: int = 1, *, eps: float = 1e-8, multi_steps: bool = False
                   ) -> optax.GradientTransformation:
    """AdamW (decoupled decay on matrices) + linear warmup + cosine, after clipping by global norm.

    ``total_steps`` counts optimizer UPDATES. Gradient accumulation normally happens inside the train step (a scan
    over ``grad_accum`` micro-batches per call, see ``make_train_step``), so ``grad_accum`` does not change the
    transformation; with ``multi_steps=True`` it is wrapped in ``optax.MultiSteps(every_k=grad_accum)`` instead,
    for callers that feed one micro-batch per call.
    """
    parts = []
    if clip_norm and clip_norm > 0:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=_decay_mask))
    parts.append(optax.inject_hyperparams(optax.scale_by_learning_rate)(
        learning_rate=lr_schedule(lr, total_steps, warmup_ratio, min_lr_ratio)))
    opt = optax.chain(*parts)
    if multi_steps and grad_accum > 1:
        opt = optax.MultiSteps(opt, every_k_schedule=grad_accum).gradient_transformation()
    return opt


def _global_norm(tree):
    tree_ns = getattr(optax, "tree", None)
    return tree_ns.norm(tree) if tree_ns is not None and hasattr(tree_ns, "norm") else optax.global_norm(tree)


def current_lr(opt_state):
    """The learning rate of the last update (from the injected hyperparams), or nan if there is none."""
    is_inj = lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    for s in jax.tree.leaves(opt_state, is_leaf=is_inj):
        if is_inj(s) and "learning_rate" in s.hyperparams:
            return jnp.asarray(s.hyperparams["learning_rate"], jnp.float32)
    return jnp.asarray(jnp.nan, jnp.float32)


# ---- shardings -----------------------------------------------------------------------------------------------------
_HEAD_LAYER_AXES = {
    "input_norm": (None,), "hidden_norm": (None,), "post_norm": (None,),
    "wq": (None, "heads", "head_dim"), "wk": (None, "kv_heads", "head_dim"), "wv": (None, "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", None), "w_gate": (None, "ffw"), "w_up": (None, "ffw"), "w_down": ("ffw", None),
}
_ALL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "ffw", "vocab", "draft_vocab")


def train_rules(head_sharding: str = "tp") -> dict[str, str | None]:
    """Logical-axis rules of the train step: the defaults, with the draft vocab on tp when the head is sharded."""
    if head_sharding not in ("tp", "replicated"):
        raise ValueError(f"head_sharding must be 'tp' or 'replicated', got {head_sharding!r}")
    return dict(DEFAULT_RULES, draft_vocab="tp" if head_sharding == "tp" else None)


def head_param_shardings(head_cfg: Eagle3Config, mesh: Mesh | None, head_sharding: str = "tp"):
    """NamedSharding tree of Eagle3Params on ``mesh`` (None when mesh is None)."""
    shapes = eagle3.param_shapes(head_cfg)
    if mesh is None:
        return jax.tree.map(lambda _: None, shapes)
    rules = train_rules(head_sharding)
    if head_sharding == "replicated":
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), shapes)

    def sh(sd, axes):
        return NamedSharding(mesh, spec_for_shape(sd.shape, axes, mesh, rules, replicate_indivisible=_ALL_AXES))

    lays = [HeadLayerParams(**{f.name: (sh(getattr(lp, f.name), _HEAD_LAYER_AXES[f.name])
                                        if getattr(lp, f.name) is not None else None)
                               for f in dataclasses.fields(HeadLayerParams)}) for lp in shapes.layers]
    return Eagle3Params(fc=sh(shapes.fc, (None, None)), layers=lays, norm=sh(shapes.norm, (None,)),
                        lm_head=sh(shapes.lm_head, (None, "draft_vocab")))


def _f32_shapes(head_cfg: Eagle3Config):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), eagle3.param_shapes(head_cfg))


def train_state_shardings(head_cfg: Eagle3Config, optimizer, mesh: Mesh | None, head_sharding: str = "tp"):
    """NamedSharding tree of TrainState: optimizer moments follow their params, everything else replicated."""
    if mesh is None:
        return None
    psh = head_param_shardings(head_cfg, mesh, head_sharding)
    rep = NamedSharding(mesh, P())
    opt_shapes = jax.eval_shape(optimizer.init, _f32_shapes(head_cfg))
    is_params = lambda x: isinstance(x, Eagle3Params)
    opt_sh = jax.tree.map(lambda x: psh if is_params(x) else rep, opt_shapes, is_leaf=is_params)
    return TrainState(params=psh, opt_state=opt_sh, step=rep, rng=rep)


def abstract_train_state(head_cfg: Eagle3Config, optimizer, mesh: Mesh | None = None, head_sharding: str = "tp"):
    """TrainState of ShapeDtypeStructs (with shardings on a mesh): the target of an orbax restore."""
    shapes = jax.eval_shape(lambda: _init_state(head_cfg, optimizer, jnp.zeros((2,), jnp.uint32), None))
    sh = train_state_shardings(head_cfg, optimizer, mesh, head_sharding)
    if sh is None:
        return shapes
    return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x), shapes, sh)


def _raw_key(key) -> jax.Array:
    if isinstance(key, int):
        return jax.random.PRNGKey(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _init_state(head_cfg, optimizer, key, init_params):
    pkey, rkey = jax.random.split(key)
    if init_params is None:
        init_params = eagle3.init_params(head_cfg.replace(dtype="float32"), pkey)
    params = jax.tree.map(lambda x: x.astype(jnp.float32), init_params)
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32), rng=rkey)


def init_train_state(head_cfg: Eagle3Config, key, optimizer, mesh: Mesh | None = None,
                     init_params: Eagle3Params | None = None, *, head_sharding: str = "tp") -> TrainState:
    """Fresh state (random head, or ``init_params`` to fine-tune a head) placed on ``mesh``. key: seed or PRNG key."""
    return _jitted_init(head_cfg, optimizer, mesh, head_sharding)(_raw_key(key), init_params)


@functools.lru_cache(maxsize=32)
def _jitted_init(head_cfg, optimizer, mesh, head_sharding):
    sh = train_state_shardings(head_cfg, optimizer, mesh, head_sharding)
    init = lambda k, p: _init_state(head_cfg, optimizer, k, p)
    # Without a mesh, committed to the default device like the step's outputs: an uncommitted first state made the
    # step compile a second program for its second call (13-16 s for SmolLM2 on a CPU; docs/benchmarks.md).
    return jax.jit(init, out_shardings=sh or SingleDeviceSharding(jax.devices()[0]))


# ---- the step ------------------------------------------------------------------------------------------------------
def _online_features(target_cfg: ModelConfig, head_cfg: Eagle3Config):
    """(target params, micro-batch) -> (embedding table, aux [B,T,3D], logits f32[B,T,V]) from the frozen target."""
    aux_ids = tuple(head_cfg.aux_layer_ids)

    def features(target_params, mb):
        ids = mb["input_ids"]
        b, t = ids.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        out = target.forward(target_params, target_cfg, ids, pos, valid=mb["attention_mask"].astype(bool),
                             aux_layers=aux_ids)
        return target_params.embed, jax.lax.stop_gradient(out.aux), jax.lax.stop_gradient(out.logits)

    return features


def _offline_features(target_cfg: ModelConfig, head_cfg: Eagle3Config):
    """(TargetEmbeddings, micro-batch with aux and target_hidden | target_logits) -> the same triple."""
    def features(temb, mb):
        if "target_logits" in mb:
            logits = mb["target_logits"].astype(jnp.float32)
        else:
            logits = target.compute_logits(temb, mb["target_hidden"].astype(jnp.dtype(target_cfg.dtype)))
        return temb.embed, jax.lax.stop_gradient(mb["aux"]), jax.lax.stop_gradient(logits)

    return features


def _check_batch(batch, grad_accum: int | None, mesh):
    batch = dict(batch)
    if batch["input_ids"].ndim == 2:  # a single micro-batch [B, T]
        if mesh is not None:
            raise ValueError("on a mesh the batch leaves must be [A, B, T] (A micro-batches; use A = 1)")
        batch = {k: v[None] for k, v in batch.items()}
    a = batch["input_ids"].shape[0]
    if grad_accum is not None and a != grad_accum:
        raise ValueError(f"batch has {a} micro-batches on its leading axis, the step was built for grad_accum="
                         f"{grad_accum}")
    return batch


def _grads_and_stats(features, head_cfg, compute_dtype, ttt_length, decay, params, target_arg, vocab_map, batch,
                     with_grad=True):
    """Summed-over-micro-batches gradients (fp32, averaged) and rollout stats (summed)."""
    dt = jnp.dtype(compute_dtype)

    def micro(mb):
        embed, aux, logits = features(target_arg, mb)

        def loss_fn(p):
            pc = jax.tree.map(lambda x: x.astype(dt), p)
            return ttt.ttt_rollout(pc, head_cfg, embed, aux, mb["input_ids"], mb["loss_mask"], mb["attention_mask"],
                                   logits, vocab_map, ttt_length=ttt_length, decay=decay)

        if not with_grad:
            return None, loss_fn(params)[1]
        (_, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return g, stats

    a = batch["input_ids"].shape[0]
    if a == 1:
        g, stats = micro(jax.tree.map(lambda x: x[0], batch))
        return g, stats

    def body(carry, mb):
        g_acc, s_acc = carry
        g, s = micro(mb)
        g_acc = jax.tree.map(jnp.add, g_acc, g) if with_grad else None
        return (g_acc, jax.tree.map(jnp.add, s_acc, s)), None

    zeros_g = jax.tree.map(jnp.zeros_like, params) if with_grad else None
    zeros_s = {k: jnp.zeros((ttt_length,), jnp.float32) for k in ttt.STAT_KEYS}
    zeros_s.update({k: jnp.zeros((), jnp.float32) for k in ttt.SCALAR_STAT_KEYS})
    (g, stats), _ = jax.lax.scan(body, (zeros_g, zeros_s), batch)
    if with_grad:
        g = jax.tree.map(lambda x: x / a, g)
    return g, stats


@dataclasses.dataclass(frozen=True)
class _StepParts:
    """What the jitted functions of a run share: the target features (online: run the frozen target; offline: the
    cached features), the head's compute dtype and sharding rules, and the shardings of the arguments (all None
    without a mesh)."""
    features: Callable
    compute_dtype: str
    rules: dict
    rep: Any = None
    batch: Any = None
    vocab_map: Any = None
    target: Any = None
    params: Any = None  # the head's params


def _step_parts(target_cfg, head_cfg, mesh, *, offline: bool, compute_dtype, head_sharding) -> _StepParts:
    features = (_offline_features if offline else _online_features)(target_cfg, head_cfg)
    parts = _StepParts(features, compute_dtype or head_cfg.dtype, train_rules(head_sharding))
    if mesh is None:
        return parts
    rep = NamedSharding(mesh, P())
    target_sh = (_embedding_shardings if offline else _target_shardings)(target_cfg, mesh)
    return dataclasses.replace(parts, rep=rep, batch=NamedSharding(mesh, P(None, "dp")),
                               vocab_map=VocabMap(d2t=rep, t2d=rep), target=target_sh,
                               params=head_param_shardings(head_cfg, mesh, head_sharding))


def _update_step(parts: _StepParts, head_cfg, optimizer, mesh, *, ttt_length, decay, grad_accum, head_sharding):
    """The jitted train step: gradients of the TTT loss, then one optimizer update (skipped when not finite)."""
    def step(state: TrainState, target_arg, vocab_map: VocabMap, batch):
        with use_mesh(mesh, parts.rules):
            batch = _check_batch(batch, grad_accum, mesh)
            grads, stats = _grads_and_stats(parts.features, head_cfg, parts.compute_dtype, ttt_length, decay,
                                            state.params, target_arg, vocab_map, batch)
            grad_norm = _global_norm(grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            rng, _ = jax.random.split(state.rng)
            metrics = ttt.finalize_metrics(stats, decay)
            # A non-finite loss, gradient or update never reaches the weights: the update is dropped (params and
            # optimizer state kept, so the lr schedule does not advance either); the caller counts `skipped`.
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & jnp.isfinite(_global_norm(updates))
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
            metrics.update(grad_norm=grad_norm, lr=current_lr(opt_state),
                           skipped=jnp.logical_not(finite).astype(jnp.float32),
                           zero_grad=((grad_norm == 0) & (metrics["valid_tokens"] > 0)).astype(jnp.float32))
            return TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=rng), metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,))
    state_sh = train_state_shardings(head_cfg, optimizer, mesh, head_sharding)
    return jax.jit(step, in_shardings=(state_sh, parts.target, parts.vocab_map, parts.batch),
                   out_shardings=(state_sh, parts.rep), donate_argnums=(0,))


def _eval_fn(parts: _StepParts, head_cfg, mesh, *, ttt_length, decay):
    """The jitted loss and metrics of the head's params, without gradients."""
    def run(params, target_arg, vocab_map, batch):
        with use_mesh(mesh, parts.rules):
            batch = _check_batch(batch, None, mesh)
            _, stats = _grads_and_stats(parts.features, head_cfg, parts.compute_dtype, ttt_length, decay, params,
                                        target_arg, vocab_map, batch, with_grad=False)
            return ttt.finalize_metrics(stats, decay)

    if mesh is None:
        return jax.jit(run)
    return jax.jit(run, in_shardings=(parts.params, parts.target, parts.vocab_map, parts.batch),
                   out_shardings=parts.rep)


def _grad_fn(parts: _StepParts, head_cfg, mesh, *, ttt_length, decay):
    """The jitted gradients the optimizer would receive, and the metrics, without an update."""
    def run(params, target_arg, vocab_map, batch):
        with use_mesh(mesh, parts.rules):
            batch = _check_batch(batch, None, mesh)
            grads, stats = _grads_and_stats(parts.features, head_cfg, parts.compute_dtype, ttt_length, decay, params,
                                            target_arg, vocab_map, batch)
            return grads, ttt.finalize_metrics(stats, decay)

    if mesh is None:
        return jax.jit(run)
    return jax.jit(run, in_shardings=(parts.params, parts.target, parts.vocab_map, parts.batch),
                   out_shardings=(parts.params, parts.rep))


def _target_shardings(target_cfg, mesh):
    return weights.param_shardings(target_cfg, mesh)


def _embedding_shardings(target_cfg, mesh):
    full = weights.param_shardings(target_cfg, mesh)
    return TargetEmbeddings(embed=full.embed, lm_head=full.lm_head)


def make_train_step(target_cfg: ModelConfig, head_cfg: Eagle3Config, optimizer, mesh: Mesh | None = None, *,
                    ttt_length: int = 7, decay: float = 0.8, grad_accum: int | None = None,
                    compute_dtype: str | None = None, head_sharding: str = "tp") -> Callable:
    """``step(state, target_params, vocab_map, batch) -> (state, metrics)``: one jit, state donated.

    batch: dict of ``input_ids``, ``loss_mask``, ``attention_mask`` i32[A, B, T] (A = grad_accum micro-batches;
    [B, T] means A = 1), B divisible by the mesh's dp. ``grad_accum`` (when given) is checked against A.
    metrics: ``loss``, ``ploss_k``, ``acc_k``, ``acc_k_allpos``, ``valid_tokens``, ``grad_norm`` (before clipping),
    ``lr`` (of this update), ``skipped`` (1.0 when the loss or gradient was not finite and the update was dropped:
    params and optimizer state unchanged, ``step`` still advances), ``zero_grad`` (1.0 when the gradient was exactly
    zero on a batch with answer tokens: a saturated head), as f32 scalars (replicated).
    """
    parts = _step_parts(target_cfg, head_cfg, mesh, offline=False, compute_dtype=compute_dtype,
                        head_sharding=head_sharding)
    return _update_step(parts, head_cfg, optimizer, mesh, ttt_length=ttt_length, decay=decay, grad_accum=grad_accum,
                        head_sharding=head_sharding)


def make_train_step_offline(target_cfg: ModelConfig, head_cfg: Eagle3Config, optimizer, mesh: Mesh | None = None, *,
                            ttt_length: int = 7, decay: float = 0.8, grad_accum: int | None = None,
                            compute_dtype: str | None = None, head_sharding: str = "tp") -> Callable:
    """Offline variant: ``step(state, target_embeddings, vocab_map, batch)`` with precomputed target features.

    batch adds ``aux`` [A, B, T, 3*D] and ``target_hidden`` [A, B, T, D] (the target's final hidden state after
    its final norm, i.e. the input of its lm_head; logits are recomputed on device with the target's lm_head).
    Storing the final hidden state costs D values per token (3,584 for Qwen2.5-7B) against V (152,064) for full
    logits, 42x less disk; even logits cut to a 32K draft vocab would be 9x larger, and the target argmax over the
    FULL vocab (needed for the position mask) could not be recovered from them. ``target_logits`` f32[A, B, T, V]
    may be passed instead of ``target_hidden``. ``target_embeddings``: ``TargetEmbeddings`` (embed, lm_head).
    """
    parts = _step_parts(target_cfg, head_cfg, mesh, offline=True, compute_dtype=compute_dtype,
                        head_sharding=head_sharding)
    return _update_step(parts, head_cfg, optimizer, mesh, ttt_length=ttt_length, decay=decay, grad_accum=grad_accum,
                        head_sharding=head_sharding)


def make_eval_step(target_cfg: ModelConfig, head_cfg: Eagle3Config, mesh: Mesh | None = None, *,
                   ttt_length: int = 7, decay: float = 0.8, compute_dtype: str | None = None,
                   head_sharding: str = "tp", offline: bool = False) -> Callable:
    """``eval(params, target_params | target_embeddings, vocab_map, batch) -> metrics`` (no update, any A)."""
    parts = _step_parts(target_cfg, head_cfg, mesh, offline=offline, compute_dtype=compute_dtype,
                        head_sharding=head_sharding)
    return _eval_fn(parts, head_cfg, mesh, ttt_length=ttt_length, decay=decay)


def make_grad_fn(target_cfg: ModelConfig, head_cfg: Eagle3Config, mesh: Mesh | None = None, *, ttt_length: int = 7,
                 decay: float = 0.8, compute_dtype: str | None = None, head_sharding: str = "tp",
                 offline: bool = False) -> Callable:
    """``grad(params, target_params, vocab_map, batch) -> (grads, metrics)``: the step without the update (tests,
    debugging). Gradients are those the optimizer would receive (averaged over micro-batches, before clipping)."""
    parts = _step_parts(target_cfg, head_cfg, mesh, offline=offline, compute_dtype=compute_dtype,
                        head_sharding=head_sharding)
    return _grad_fn(parts, head_cfg, mesh, ttt_length=ttt_length, decay=decay)


def make_feature_fn(target_cfg: ModelConfig, head_cfg: Eagle3Config, mesh: Mesh | None = None) -> Callable:
    """``features(target_params, input_ids, attention_mask) -> {aux, target_hidden}`` ([B, T, ...] in the target
    dtype): what the offline cache stores per sequence (see ``make_train_step_offline``)."""
    aux_ids = tuple(head_cfg.aux_layer_ids)

    def fn(target_params, input_ids, attention_mask):
        with use_mesh(mesh):
            b, t = input_ids.shape
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
            out = target.forward(target_params, target_cfg, input_ids, pos, valid=attention_mask.astype(bool),
                                 aux_layers=aux_ids, return_logits=False, return_hidden=True)
            return {"aux": out.aux, "target_hidden": out.hidden}

    if mesh is None:
        return jax.jit(fn)
    bsh = NamedSharding(mesh, P("dp"))
    return jax.jit(fn, in_shardings=(weights.param_shardings(target_cfg, mesh), bsh, bsh), out_shardings=bsh)


# ---- FLOPs -----------------------------------------------------------------------------------------------------------
# Dense bf16 peak TFLOP/s per device (chip / GPU), by device_kind substring (longest match wins): the MFU
# denominator of the trainer and of ``bench train``.
PEAK_TFLOPS = {"TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
               "TPU v6 lite": 918.0, "TPU v6e": 918.0, "H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
               "H200": 989.0, "H200 NVL": 835.0, "A100": 312.0, "L4": 121.0}
# Published memory bandwidth (GB/s) of the same kinds: the datasheet ceiling of a memory-bound decode step (a bare
# "H100" / "A100" is the SXM part, the A100's 80 GB one). Names are matched longest first inside jax's device_kind.
PEAK_HBM_GBPS = {"TPU v4": 1200.0, "TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5p": 2765.0, "TPU v5": 2765.0,
                 "TPU v6 lite": 1640.0, "TPU v6e": 1640.0, "H100": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0,
                 "H200": 4800.0, "A100": 2039.0, "A100-SXM4-40GB": 1555.0, "A100-PCIE-40GB": 1555.0,
                 "A100 80GB PCIe": 1935.0, "L4": 300.0}


def _by_kind(table: dict[str, float], device_kind: str) -> tuple[float, str] | None:
    """(value, the table's name for it) of the longest table name inside ``device_kind``, or None."""
    for name in sorted(table, key=len, reverse=True):
        if name.lower() in device_kind.lower():
            return table[name], name
    return None


def peak_tflops(device_kind: str) -> tuple[float, str] | None:
    """(dense bf16 peak TFLOP/s, the table's name for it) of a device kind, or None when the table lacks it."""
    return _by_kind(PEAK_TFLOPS, device_kind)


def peak_hbm_gbps(device_kind: str) -> tuple[float, str] | None:
    """(published memory bandwidth GB/s, the table's name for it) of a device kind, or None when the table lacks it."""
    return _by_kind(PEAK_HBM_GBPS, device_kind)


def estimate_flops_per_token(target_cfg: ModelConfig, head_cfg: Eagle3Config, seq_len: int, ttt_length: int = 7,
                             *, include_target: bool = True) -> float:
    """Model FLOPs per training token (matmuls only, 2 per multiply-add, attention over the full T x T scores, not
    halved for causality, PaLM's convention; the attention kernel skips the key blocks a causal mask hides from
    T >= 512, ``layers.query_chunks``): the target's forward, plus the head's forward + backward (3x forward) over
    the fc projection and ``ttt_length`` rollout steps. For MFU = this * tokens/s / (peak * devices). Within about
    1% of the step's compiled dot FLOPs (the fc's input gradient, not computed, and the draft lm_head over T rather
    than T - k rows are counted)."""
    t = seq_len
    c = target_cfg
    d, f, n, k, hd, v = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    per_layer = d * n * hd + 2 * d * k * hd + n * hd * d + 3 * d * f
    target_fwd = 2 * (c.num_layers * per_layer + d * v) + c.num_layers * 4 * t * n * hd
    h = head_cfg
    hh, hf, hn, hk, hhd = h.hidden_size, h.intermediate_size, h.num_heads, h.num_kv_heads, h.head_dim
    fc = 2 * len(h.aux_layer_ids) * h.target_hidden_size * hh
    step = 0.0
    for li in range(h.num_layers):
        din = 2 * hh if li == 0 else hh
        step += 2 * (din * (hn + 2 * hk) * hhd + hn * hhd * hh + 3 * hh * hf)
    step += 2 * hh * h.draft_vocab_size
    head_fwd = fc + sum(step + h.num_layers * 4 * hn * hhd * (t + kk) for kk in range(ttt_length))
    return float((target_fwd if include_target else 0.0) + 3 * head_fwd)


__all__ = ["TrainState", "TargetEmbeddings", "target_embeddings", "make_optimizer", "lr_schedule", "current_lr",
           "init_train_state", "make_train_step", "make_train_step_offline", "make_eval_step", "make_grad_fn",
           "make_feature_fn", "estimate_flops_per_token", "head_param_shardings", "train_state_shardings",
           "abstract_train_state", "train_rules"]
