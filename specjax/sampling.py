"""Per-request sampling on device: one definition of the target distribution used by plain generation,
speculative verification and the server, so that "lossless" means the same thing everywhere.

A request's parameters travel as ONE typed host row (``SamplingRow``); rows are batched into device arrays
(``SamplingBatch``) that also carry each row's penalty state (output token counts, prompt tokens, tokens generated)
and the log-probabilities of the tokens it emitted last. Every parameter is data, never a static argument: a batch
mixes greedy, sampled, penalised and logprob rows in ONE compiled program; ``lax.cond`` skips the penalty and logprob
work when no row of the batch asks for it (so a plain batch costs what it did before these parameters existed).

Order (as vLLM / SGLang / HF): the raw logits get
  1. repetition_penalty (HF/CTRL: over prompt + output tokens, positive logits divided, negative multiplied),
  2. frequency_penalty * count + presence_penalty * [count > 0] subtracted (OpenAI: over output tokens only),
  3. logit_bias added,
  4. min_new_tokens: the row's stop tokens (eos unless ignore_eos, plus stop_token_ids) set to -inf while fewer than
     min_new_tokens tokens were generated;
then temperature -> top_k -> top_p -> min_p. temperature == 0 means greedy (argmax of the penalised logits).
Log-probabilities (SGLang's definition): log_softmax(penalised logits / temperature), temperature 1 for greedy rows,
before top_k / top_p / min_p filtering.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import platforms
from specjax.kernels import cpu_dense

MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
MAX_STOP_IDS = 64  # stop token ids per request that min_new_tokens can hold back
TOP_LOGPROBS = 20  # most top logprobs per emitted token (OpenAI's limit); every logprob batch computes this many
MAX_TOKEN_IDS_LOGPROB = 32  # token ids per request whose logprobs every step reports (SGLang's token_ids_logprob)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One request's sampling parameters, as the runners take them (SGLang's names and defaults).
    ``stop_ids``: the tokens min_new_tokens holds back (eos unless ignore_eos, plus stop_token_ids).
    ``seed`` None: the runner draws one."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_ids: tuple[int, ...] = ()
    logprobs: bool = False
    logprob_ids: tuple[int, ...] = ()  # tokens whose logprobs each emitted token reports (needs ``logprobs``)

    @classmethod
    def coerce(cls, x: "SamplingRow | Mapping[str, Any] | None") -> "SamplingRow":
        """A SamplingRow from itself or a mapping with its field names (unknown names are refused)."""
        if isinstance(x, SamplingRow):
            return x
        d = dict(x or {})
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown sampling field(s) {unknown}")
        if isinstance(d.get("logit_bias"), Mapping):
            d["logit_bias"] = tuple((int(k), float(v)) for k, v in d["logit_bias"].items())
        for k in ("logit_bias", "stop_ids", "logprob_ids"):
            if k in d:
                d[k] = tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in d[k])
        return cls(**d)

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens > 0 or self.logit_bias)

    def validate(self, vocab_size: int | None = None) -> None:
        """ValueError with a clear message for an out-of-range parameter."""
        validate(self.temperature, self.top_k, self.top_p, self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias:
            if not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
        _check_ids("logit_bias", [t for t, _ in self.logit_bias], vocab_size)
        if len(self.logprob_ids) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob has {len(self.logprob_ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB}")
        _check_ids("token_ids_logprob", self.logprob_ids, vocab_size)
        if self.min_new_tokens > 0 and len(set(self.stop_ids)) > MAX_STOP_IDS:
            raise ValueError(f"min_new_tokens can hold back at most {MAX_STOP_IDS} stop token ids, got "
                             f"{len(set(self.stop_ids))}")


def _check_ids(name: str, ids, vocab_size: int | None) -> None:
    """ValueError naming ``name`` for the first id outside [0, vocab_size) (or below 0 when the size is unknown)."""
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, vocab size)"
        raise ValueError(f"{name} token id {bad} is outside {where}")


class Seeds:
    """Seeds for rows that bring none (``SamplingRow.seed`` None): a different stream for every request."""

    def __init__(self):
        self._n = 0

    def next(self, row: SamplingRow) -> int:
        if row.seed is not None:
            return int(row.seed)
        self._n += 1
        return hash((id(self), self._n)) & 0x7FFFFFFF


def _key_data(seed: int) -> np.ndarray:
    """u32[2]: ``jax.random.key_data(jax.random.PRNGKey(seed % 2**32))`` (threefry), without a device call."""
    return np.asarray([0, int(seed) % (1 << 32)], np.uint32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Sampling parameters and per-row state of B rows (requests / slots), as device arrays."""
    temperature: jax.Array  # f32[B]  0 = greedy
    top_k: jax.Array  # i32[B]  <= 0 = off
    top_p: jax.Array  # f32[B]  1 = off
    min_p: jax.Array  # f32[B]  0 = off
    key: jax.Array  # u32[B, 2] per-row PRNG key, fixed for the request (``token_uniforms``: its n-th token's draw)
    frequency_penalty: jax.Array  # f32[B]  0 = off
    presence_penalty: jax.Array  # f32[B]  0 = off
    repetition_penalty: jax.Array  # f32[B]  1 = off
    min_new: jax.Array  # i32[B]  min_new_tokens
    bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS] logit_bias token ids, -1 = unused
    bias_vals: jax.Array  # f32[B, MAX_LOGIT_BIAS]
    stop_ids: jax.Array  # i32[B, MAX_STOP_IDS] tokens min_new_tokens holds back, -1 = unused
    want_logprobs: jax.Array  # bool[B]
    logprob_ids: jax.Array  # i32[B, MAX_TOKEN_IDS_LOGPROB] tokens whose logprobs are reported, -1 = unused
    # Per-row state.
    generated: jax.Array  # i32[B] tokens emitted so far
    counts: jax.Array  # i32[B, V] how often each token was emitted (V = 1 in a batch built without a vocab)
    prompt_seen: jax.Array  # bool[B, V] tokens of the prompt (repetition_penalty)
    # Log-probabilities of the tokens the row emitted in its latest step (W = tokens per step).
    logprob: jax.Array  # f32[B, W]
    top_ids: jax.Array  # i32[B, W, TOP_LOGPROBS]
    top_logprobs: jax.Array  # f32[B, W, TOP_LOGPROBS]
    ids_logprobs: jax.Array  # f32[B, W, MAX_TOKEN_IDS_LOGPROB] the logprobs of ``logprob_ids``

    @classmethod
    def make(cls, batch: int, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, *, vocab: int = 1,
             width: int = 1) -> "SamplingBatch":
        """Unpenalised rows (scalars or one value per row). ``vocab``: the size of the penalty state (1 = a batch
        that never penalises); ``width``: tokens per step (logprob buffers)."""
        def col(v, dt):
            return np.broadcast_to(np.asarray(v, dt), (batch,)).copy()
        seeds = np.broadcast_to(np.asarray(seed), (batch,))
        return cls.from_arrays(
            dict(temperature=col(temperature, np.float32), top_k=col(top_k, np.int32), top_p=col(top_p, np.float32),
                 min_p=col(min_p, np.float32), key=np.stack([_key_data(int(s)) for s in seeds])),
            batch, vocab, width)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab: int, prompts: Sequence[Sequence[int]] | None = None,
                  width: int = 1, seeds: Sequence[int] | None = None) -> "SamplingBatch":
        """Device batch of ``rows``; ``prompts`` (token ids per row) for repetition_penalty; ``seeds`` override
        each row's seed (None: row.seed, else 0)."""
        b = len(rows)
        a = {f: np.asarray([getattr(r, f) for r in rows], dt) for f, dt in (
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("min_p", np.float32),
            ("frequency_penalty", np.float32), ("presence_penalty", np.float32),
            ("repetition_penalty", np.float32))}
        a["min_new"] = np.asarray([r.min_new_tokens for r in rows], np.int32)
        a["want_logprobs"] = np.asarray([r.logprobs for r in rows], bool)
        seeds = [r.seed or 0 for r in rows] if seeds is None else seeds
        a["key"] = np.stack([_key_data(int(s)) for s in seeds])
        a["bias_ids"] = np.full((b, MAX_LOGIT_BIAS), -1, np.int32)
        a["bias_vals"] = np.zeros((b, MAX_LOGIT_BIAS), np.float32)
        a["stop_ids"] = np.full((b, MAX_STOP_IDS), -1, np.int32)
        a["logprob_ids"] = np.full((b, MAX_TOKEN_IDS_LOGPROB), -1, np.int32)
        a["prompt_seen"] = np.zeros((b, vocab), bool)
        for i, r in enumerate(rows):
            a["logprob_ids"][i, :len(r.logprob_ids)] = r.logprob_ids
            if r.logit_bias:
                ids, vals = zip(*r.logit_bias)
                a["bias_ids"][i, :len(ids)], a["bias_vals"][i, :len(ids)] = ids, vals
            stops = sorted(set(r.stop_ids))[:MAX_STOP_IDS]
            a["stop_ids"][i, :len(stops)] = stops
            if prompts is not None and r.repetition_penalty != 1.0:
                a["prompt_seen"][i, np.asarray(prompts[i], np.int64)] = True
        return cls.from_arrays(a, b, vocab, width)

    @classmethod
    def from_arrays(cls, a: dict, batch: int, vocab: int, width: int) -> "SamplingBatch":
        defaults = dict(
            frequency_penalty=np.zeros((batch,), np.float32), presence_penalty=np.zeros((batch,), np.float32),
            repetition_penalty=np.ones((batch,), np.float32), min_new=np.zeros((batch,), np.int32),
            bias_ids=np.full((batch, MAX_LOGIT_BIAS), -1, np.int32),
            bias_vals=np.zeros((batch, MAX_LOGIT_BIAS), np.float32),
            stop_ids=np.full((batch, MAX_STOP_IDS), -1, np.int32), want_logprobs=np.zeros((batch,), bool),
            logprob_ids=np.full((batch, MAX_TOKEN_IDS_LOGPROB), -1, np.int32),
            generated=np.zeros((batch,), np.int32), counts=np.zeros((batch, vocab), np.int32),
            prompt_seen=np.zeros((batch, vocab), bool), logprob=np.zeros((batch, width), np.float32),
            top_ids=np.zeros((batch, width, TOP_LOGPROBS), np.int32),
            top_logprobs=np.zeros((batch, width, TOP_LOGPROBS), np.float32),
            ids_logprobs=np.zeros((batch, width, MAX_TOKEN_IDS_LOGPROB), np.float32))
        defaults.update(a)
        # device_put, not jnp.asarray: in JAX 0.10 the latter compiles a staging program per new shape (13 here)
        return cls(**{k: jax.device_put(v) for k, v in defaults.items()})

    @property
    def greedy(self):
        return self.temperature <= 0.0  # bool[B]

    @property
    def penalised(self):
        """bool[B]: rows whose logits the penalties / bias / min_new_tokens change (at this step)."""
        return ((self.frequency_penalty != 0) | (self.presence_penalty != 0) | (self.repetition_penalty != 1)
                | (self.bias_vals != 0).any(-1) | (self.generated < self.min_new))


def validate(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Raise ValueError with a clear message for out-of-range sampling parameters (NaN and infinities included)."""
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or a positive integer, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def _expand(a, ndim: int):
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _penalise(logits, sb: SamplingBatch, tree=None):
    """Steps 1-4 of the module docstring on f32[B, V], or on f32[B, M, V] tree nodes with ``tree`` = (tokens
    i32[B, M], ancestor-or-self mask bool[B, M, M], depth i32[B, M]): a node's penalties also count the tokens
    drafted on its path, and its successor is generated after ``depth`` more tokens."""
    x = logits.astype(jnp.float32)
    v, nd = x.shape[-1], x.ndim
    counts = sb.counts.astype(jnp.float32)
    generated, seen = sb.generated, sb.prompt_seen
    if tree is not None:
        tokens, mask, depth = tree
        counts = counts[:, None, :] + tree_counts(tokens, mask, v)
        generated, seen = generated[:, None] + depth, seen[:, None, :]
    rows = jnp.arange(x.shape[0])[:, None]
    seen = seen | (counts > 0)
    rp = _expand(sb.repetition_penalty, nd)
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    x = x - _expand(sb.frequency_penalty, nd) * counts - _expand(sb.presence_penalty, nd) * (counts > 0)
    bias = jnp.zeros((x.shape[0], v), jnp.float32).at[rows, jnp.where(sb.bias_ids < 0, v, sb.bias_ids)].add(
        sb.bias_vals, mode="drop")
    stops = jnp.zeros((x.shape[0], v), bool).at[rows, jnp.where(sb.stop_ids < 0, v, sb.stop_ids)].set(
        True, mode="drop")
    if tree is not None:
        bias, stops = bias[:, None, :], stops[:, None, :]
    x = x + bias
    return jnp.where(stops & (generated < _expand(sb.min_new, generated.ndim))[..., None], -jnp.inf, x)


def process_logits(logits, sb: SamplingBatch, tree=None):
    """The penalised logits f32[B, (M,) V] (the raw ones, as f32, when no row of the batch is penalised)."""
    if sb.counts.shape[-1] != logits.shape[-1]:  # a batch built without a vocab never penalises
        return logits.astype(jnp.float32)
    if tree is not None and logits.shape[1] == 1:
        # A root-only tree (a target-only step) is a plain step: its root is already counted, so its penalties are
        # the [B, V] ones. As [B, 1, V] through the cond, XLA:CPU copied the logits (its branches chose different
        # layouts for the unit axis: 3 MB, 0.7 ms of a batch-16 step).
        return process_logits(logits[:, 0], sb)[:, None]
    return jax.lax.cond(sb.penalised.any(), lambda: _penalise(logits, sb, tree), lambda: logits.astype(jnp.float32))


def tree_counts(tokens, mask, vocab: int):
    """f32[B, M, V]: per tree node, how often each token occurs among its drafted ancestors and itself (the root,
    node 0, is already emitted and counted). tokens i32[B, M]; mask bool[B, M, M] ancestor-or-self."""
    drafted = mask & (jnp.arange(mask.shape[-1]) > 0)[None, None, :]
    return jnp.einsum("bma,bav->bmv", drafted.astype(jnp.float32), jax.nn.one_hot(tokens, vocab, dtype=jnp.float32))


def _order_key(x):
    """u32 keys that order like the f32 values ``x`` (-inf < negatives < 0 < positives < inf)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_key(keys, pred):
    """Per row of u32 ``keys`` [..., V], the largest t with ``pred(t)`` (t u32[..., 1]; monotone: true at 0 and up to
    the answer), found bit by bit: 32 masked reductions over the vocabulary instead of a sort of it."""
    def bit(i, t):
        cand = t | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        return jnp.where(pred(cand), cand, t)
    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:-1] + (1,), jnp.uint32))


def _top_k(x, k):
    """Keep the values >= the k-th largest of each row (k i32 broadcast to [..., 1], in [1, V])."""
    keys = _order_key(x)
    kth = _largest_key(keys, lambda t: (keys >= t).sum(-1, keepdims=True) >= k)
    return jnp.where(keys >= kth, x, -jnp.inf)


def _top_p(p, top_p):
    """Keep the smallest set of largest probabilities whose mass reaches ``top_p`` (ties at the edge kept): the
    threshold is the largest probability t with mass(p >= t) >= top_p. Rows with top_p >= 1 keep everything."""
    keys = _order_key(p)
    edge = _largest_key(keys, lambda t: jnp.where(keys >= t, p, 0.0).sum(-1, keepdims=True) >= top_p)
    return jnp.where((keys >= edge) | (top_p >= 1), p, 0.0)


def argmax(x):
    """i32[...]: the first index of the largest value along the last axis of x [..., V] (``jnp.argmax``): a greedy
    token, the target's choice after a verified node. A CPU's fp32 logits take the kernel ``cpu_dense.argmax``
    (XLA:CPU's reduction spent 0.2-0.3 ms on each row of SmolLM2's 49,152 logits)."""
    def xla(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if cpu_dense.supports_argmax(x):
        return platforms.select(x, cpu=cpu_dense.argmax, default=xla)
    return xla(x)


def target_probs(logits, temperature, top_k, top_p, min_p):
    """Processed distribution f32[..., V] from (penalised) logits f32[..., V]; params broadcast over the leading
    axes ([B] -> [B, ...]). Greedy rows (temperature 0) get a one-hot on the argmax. The top-k and top-p edges are
    found by bisection on the values (no sort of the vocabulary), and only when some row uses the filter."""
    v = logits.shape[-1]
    expand = lambda a: _expand(a, logits.ndim)
    t = expand(temperature)
    greedy = t <= 0
    x = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t)
    k = jnp.where(top_k <= 0, v, jnp.minimum(top_k, v))
    x = jax.lax.cond((k < v).any(), lambda: _top_k(x, expand(k)), lambda: x)
    p = jax.nn.softmax(x, axis=-1)
    p = jax.lax.cond((top_p < 1).any(), lambda: _top_p(p, expand(top_p)), lambda: p)
    # min-p: drop tokens below min_p * max prob.
    p = jnp.where(p >= expand(min_p) * p.max(-1, keepdims=True), p, 0.0)
    p = p / p.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(argmax(logits), v, dtype=jnp.float32)
    return jnp.where(greedy, onehot, p)


def token_uniforms(keys, index):
    """f32[B, W, 2]: two uniforms in [0, 1) for the generated tokens at ``index`` i32[B, W] (0 = a request's first
    token) of each row, from the row's key u32[B, 2] folded with the index. A token's draws depend on the request's
    seed and on which token it is, nothing else: not on how many tokens each step emitted, the batch or a tree's
    shape, so plain and speculative decoding draw the same randomness for the same token."""
    def row(k, ix):
        key = jax.random.wrap_key_data(k)
        return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (2,), jnp.float32))(ix)
    return jax.vmap(row)(keys, index)


CDF_BLOCK = 256  # ``inverse_cdf`` sums the vocabulary in blocks of this many ids, then runs within one block


def _last_nonzero(x, axis=-1):
    """The index of the last entry > 0 along ``axis`` (0 if none)."""
    n = x.shape[axis]
    return n - 1 - jnp.argmax(jnp.flip(x > 0, axis=axis), axis=axis)


def inverse_cdf(probs, u):
    """The token t with cdf(t - 1) <= u * total < cdf(t) over the vocabulary in id order (total: the row's mass, so
    a row that sums to 1 only up to rounding is drawn exactly as a normalised one): i32[...] from f32[..., V] and
    uniforms f32[...]. Exact categorical sampling from one uniform, always a token of nonzero probability. The
    cumulative sum is taken in two levels (the sums of blocks of ``CDF_BLOCK`` ids, then within the block the draw
    falls in): one pass over the row instead of a running sum of it (a [16, 49152] batch 1.2 ms, not 4.3)."""
    v = probs.shape[-1]
    nb = -(-v // CDF_BLOCK)
    blocks = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, nb * CDF_BLOCK - v)]).reshape(
        probs.shape[:-1] + (nb, CDF_BLOCK))
    sums = blocks.sum(-1)  # [..., nb]
    cum = jnp.cumsum(sums, axis=-1)
    t = u * cum[..., -1]
    # u * total may round up to total: the draw stays in the last block, and at the last token, with mass
    k = jnp.minimum(jnp.sum(cum <= t[..., None], axis=-1), _last_nonzero(sums))
    before = jnp.where(k > 0, jnp.take_along_axis(cum, jnp.maximum(k - 1, 0)[..., None], axis=-1)[..., 0], 0.0)
    inner = jnp.take_along_axis(blocks, k[..., None, None], axis=-2)[..., 0, :]  # [..., CDF_BLOCK]
    j = jnp.sum(before[..., None] + jnp.cumsum(inner, axis=-1) <= t[..., None], axis=-1)
    return jnp.minimum(k * CDF_BLOCK + jnp.minimum(j, _last_nonzero(inner)), v - 1).astype(jnp.int32)  # (NaN rows)


def token_logprobs(x, sb: SamplingBatch, tokens, x_rows=None):
    """SGLang's logprobs of ``tokens`` i32[B, W] under penalised logits x f32[B, W, V] (or, with ``x_rows``
    i32[B, W], under rows ``x_rows`` of x f32[B, M, V]: the nodes of a verified tree that emitted them, gathered
    only when needed): (f32[B, W], top ids i32[B, W, TOP_LOGPROBS], top logprobs f32[B, W, TOP_LOGPROBS], the
    logprobs of each row's ``logprob_ids`` f32[B, W, MAX_TOKEN_IDS_LOGPROB]); computed only when a row asks."""
    b, w = tokens.shape
    k = min(TOP_LOGPROBS, x.shape[-1])

    def compute():
        xs = x if x_rows is None else jnp.take_along_axis(x, x_rows[:, :, None], axis=1)
        t = jnp.where(sb.greedy, 1.0, sb.temperature)[:, None, None]
        lp = jax.nn.log_softmax(xs / t, axis=-1)
        lp = jnp.maximum(lp, jnp.finfo(jnp.float32).min)  # -inf (min_new_tokens, bias) -> finite, as SGLang
        top_lp, top_ids = jax.lax.top_k(lp, k)
        pad = TOP_LOGPROBS - k
        ids = jnp.broadcast_to(jnp.maximum(sb.logprob_ids, 0)[:, None, :], (b, w, MAX_TOKEN_IDS_LOGPROB))
        return (jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0],
                jnp.pad(top_ids.astype(jnp.int32), ((0, 0), (0, 0), (0, pad))),
                jnp.pad(top_lp, ((0, 0), (0, 0), (0, pad))), jnp.take_along_axis(lp, ids, axis=-1))

    def skip():
        return (jnp.zeros((b, w), jnp.float32), jnp.zeros((b, w, TOP_LOGPROBS), jnp.int32),
                jnp.zeros((b, w, TOP_LOGPROBS), jnp.float32), jnp.zeros((b, w, MAX_TOKEN_IDS_LOGPROB), jnp.float32))

    return jax.lax.cond(sb.want_logprobs.any(), compute, skip)


def record(sb: SamplingBatch, tokens, n, x=None, active=None, x_rows=None) -> SamplingBatch:
    """The row state after emitting ``tokens`` i32[B, W] (the first ``n`` i32[B] of each row): counts, generated and,
    from the penalised logits ``x`` f32[B, W, V] that produced them (rows ``x_rows`` of x: ``token_logprobs``), their
    logprobs. Inactive rows keep theirs."""
    w = tokens.shape[1]
    take = jnp.arange(w)[None, :] < n[:, None]
    if active is not None:
        take = take & active[:, None]
    rows = jnp.arange(tokens.shape[0])[:, None]
    counts = sb.counts
    if counts.shape[-1] > 1:
        counts = counts.at[rows, jnp.where(take, tokens, counts.shape[-1])].add(1, mode="drop")
    new = dataclasses.replace(sb, counts=counts, generated=sb.generated + take.sum(-1).astype(jnp.int32))
    if x is not None:
        pad = sb.logprob.shape[1] - w  # a speculative row's prefill emits 1 of its W tokens per step
        lp, ids, top, by_id = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
                               for a in token_logprobs(x, sb, tokens, x_rows))
        keep = lambda a, b: jnp.where(_expand(active, a.ndim), a, b) if active is not None else a
        new = dataclasses.replace(new, logprob=keep(lp, sb.logprob), top_ids=keep(ids, sb.top_ids),
                                  top_logprobs=keep(top, sb.top_logprobs),
                                  ids_logprobs=keep(by_id, sb.ids_logprobs))
    return new


def sample_next(logits, sb: SamplingBatch, active=None):
    """Next token per row from f32[B, V] logits -> (i32[B], SamplingBatch with the token recorded). A sampled row
    draws its n-th token (n = ``generated``) by ``inverse_cdf`` at the first of ``token_uniforms``' draws for n,
    as a verified tree does (``verify.accept``), so speculative sampling emits the tokens plain sampling does.
    ``active`` bool[B] (default all): rows outside it keep their records (a request waiting in its slot, e.g.
    while its prompt is scored). When every active row is greedy only the argmax runs (the sampling path, a softmax,
    filters and a draw over the vocabulary, costs a small model's decode step on CPU a good part of its time)."""
    x = process_logits(logits, sb)
    greedy_tok = argmax(x)  # i32[B]
    greedy = sb.greedy if active is None else sb.greedy | ~active

    def sampled():
        probs = target_probs(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p)
        u = token_uniforms(sb.key, sb.generated[:, None])[:, 0, 0]
        return jnp.where(sb.greedy, greedy_tok, inverse_cdf(probs, u))

    tok = jax.lax.cond(greedy.all(), lambda: greedy_tok, sampled)
    sb = record(sb, tok[:, None], jnp.ones_like(tok), x[:, None], active)
    return tok, sb


def read_logprobs(sb: SamplingBatch, ids: bool = True):
    """Host copies (f32[B, W], i32[B, W, TOP_LOGPROBS], f32[B, W, TOP_LOGPROBS], f32[B, W, MAX_TOKEN_IDS_LOGPROB])
    of the logprobs of the tokens each row emitted in its latest step (prefill: column 0), its top tokens' and its
    ``logprob_ids``' (None without ``ids``: no row asks for them)."""
    return (np.asarray(sb.logprob), np.asarray(sb.top_ids), np.asarray(sb.top_logprobs),
            np.asarray(sb.ids_logprobs) if ids else None)
