"""CPU products over a few rows (a batch-1 decode step, a verified tree, a draft step) as XLA FFI custom calls.

XLA:CPU runs each matrix-vector product on one thread and its bf16 dot with an f32 result no faster than fp32, so a
batch-1 decode step read its weights at one core's rate whatever the thread count, and bf16 weights bought nothing
(docs/benchmarks.md). ``dense.cc`` splits each product into chunks that a small pool of threads takes in turn, reads
bf16 weights as bf16, and gives every output element one fixed sequence of fused multiply-adds: its bits do not
depend on the number of rows or threads, so a verified tree row is bitwise the one-row decode step. The decode
layout holds fp32 and bf16 matrices packed (``PackedWeight``, ``pack``: panels of 32 columns, row after row), which
the kernel reads as one stream per thread with the sums of a tile of rows of x in registers, for any number of
rows, with the bits of [C, O]. Where the CPU has AMX-BF16 and the OS lends its tiles (``amx``; ``amx.h``), bf16 x
against bf16 panels runs on the tiles from two rows on (SmolLM2's products over 8 rows then take 1.1-1.4x one
row's time, against the widening fmas' 1.5-1.6x; prompt chunks 1.5-1.9x the AVX512-BF16 dot products' rate) and one
row in the tiles' summation order on the vector units: bits of their own, still the same at every row count and
thread count; ``SPECJAX_CPU_AMX=0`` keeps the fma chain.

``attention.cc`` is the cache attention of those few tokens over the paged KV pool (``paged_attention``), and of a
prompt chunk's tokens (blocked, flash attention's way: SmolLM2's 512-token chunk after 512 cached tokens 1.9x
XLA's block loop), on the same pool, ``pages.cc`` the write of their keys and values into that pool in place
(``kv_write``) and the read of a block of its pages (``take_pages``, for the XLA attention path),
``argmax.cc`` the argmax of logits rows (``argmax``: a greedy token, the target's choice after each verified node), and
``norm.cc`` an RMSNorm of any number of rows (``rms_norm``, every CPU ``layers.rms_norm``), ``rope.cc`` the split of a
fused q/k/v projection with the rotary embedding of q and k (``rope_qkv``, ``layers.rope_qkv``).
The library is compiled from the sources (and ``common.h``) with the system C++ compiler on first use (a few
seconds; ``-march=native``) into ``$SPECJAX_CACHE/kernels/`` (one file per source, jaxlib version and CPU), and
registered with XLA. Without a compiler, or with ``SPECJAX_CPU_KERNELS=0``, ``available()`` is False and ``layers``
keeps XLA's own dots and attention; so it is on a CPU with neither AVX-512 nor AVX2 + FMA (the kernels' vector code,
``common.h``'s ``F16``), where their scalar loops are slower than XLA's, unless ``SPECJAX_CPU_KERNELS=1``.
``SPECJAX_CPU_MARCH`` replaces ``-march=native``.
``SPECJAX_CPU_THREADS`` (default: the CPUs this process may run on) or ``set_threads`` sets the pool size.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from specjax.hub import default_cache_dir

__all__ = ["available", "supports", "supports_prompt", "supports_attention", "supports_argmax", "supports_pages",
           "supports_norm", "supports_rope", "disabled", "dense", "dense_prompt", "unembed", "paged_attention",
           "argmax", "kv_write", "take_pages", "rms_norm", "rope_qkv", "PackedWeight", "pack", "packable", "PANEL",
           "dense_packed", "dense_packed_add", "pack_table",
           "set_threads", "threads", "amx", "MAX_TOKENS", "MAX_PROMPT_ROWS", "DTYPES"]

log = logging.getLogger("specjax")

HERE = Path(__file__).parent
# compiled together; all include common.h
SOURCES = (HERE / "dense.cc", HERE / "attention.cc", HERE / "argmax.cc", HERE / "pages.cc", HERE / "norm.cc",
           HERE / "rope.cc")
HEADERS = (HERE / "common.h", HERE / "amx.h")
# Products whose x has at most this many rows per sequence (x [..., T, C]: a decode step, a verified tree of up to
# 15 tokens, a draft step) take the kernels, whatever the batch, so a verified row goes through the same kernel as
# the decode step it must equal, bit for bit. A server's short prefill chunks (8 and 15 tokens:
# ``batching.serving_prefill_buckets``) take them too, 2-2.5x faster than a 16-token GEMM. Longer prefill chunks
# (from ``batching.MIN_PREFILL_BUCKET``, MAX_TOKENS + 1 tokens) keep XLA's attention, and XLA's GEMMs past
# MAX_PROMPT_ROWS rows, which use more of the cores' arithmetic over many rows (docs/benchmarks.md).
MAX_TOKENS = 15
# A longer fp32 product of at most this many rows in all (a prompt chunk of 16-32 tokens at batch 1, two of 16 at
# batch 2) also runs in the kernels, on their register tiles (17+ rows): a 17-32-token SmolLM2 prefill took 62 ms
# against XLA's 73-74 (docs/benchmarks.md, thirtieth session). bf16 products of that size keep XLA's.
MAX_PROMPT_ROWS = 32
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


def _flags() -> tuple[str, ...]:
    """FLAGS, with ``-march=$SPECJAX_CPU_MARCH`` where that is set (``x86-64``: the scalar loops, as on a CPU with
    neither AVX-512 nor AVX2 + FMA; tests/test_cpu_dense.py compares their bits with this CPU's vector code)."""
    march = os.environ.get("SPECJAX_CPU_MARCH", "")
    return tuple(f"-march={march}" if march and f.startswith("-march=") else f for f in FLAGS)


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines + [platform.machine()])


def library_path() -> Path:
    """Where the compiled library for this source, jaxlib and CPU lives."""
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, jaxlib.__version__, " ".join(_flags()), _cpu_signature()])
                         .encode()).hexdigest()[:16]
    return Path(default_cache_dir()) / "kernels" / f"specjax_cpu_dense_{key}.so"


def _compile(out: Path) -> None:
    """Compile the kernels' sources into ``out`` (written under a temporary name and renamed: concurrent builds are
    safe): each source into an object file, as many at once as this process may use CPUs (dense.cc, the largest, took
    about half of a 2-core machine's 40-80 s build), then linked. ``_compile_once`` has made ``out``'s folder."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    flags = [*_flags(), "-I", jax.ffi.include_dir(), "-I", str(HERE)]
    with tempfile.TemporaryDirectory(dir=out.parent) as objects:
        try:
            sources = sorted(SOURCES, key=lambda src: -src.stat().st_size)  # the long one does not start last
            objs = [os.path.join(objects, f"{src.stem}.o") for src in sources]
            jobs = [[cxx, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)]
            with concurrent.futures.ThreadPoolExecutor(min(len(jobs), _usable_cpus())) as pool:
                for done in pool.map(_run_compiler, jobs):
                    done.check_returncode()
            _run_compiler([cxx, *_flags(), *objs, "-o", tmp]).check_returncode()
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _compile_once(out: Path) -> None:
    """Compile the library into ``out`` unless another process is doing so: processes starting together (two pytest
    workers, two servers on a fresh machine) wait for the first one's build (40-80 s of a 2-core machine) under a
    lock file instead of each building its own."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            log.info("compiling specjax's CPU kernels into %s", out)
            _compile(out)


def _run_compiler(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECJAX_CPU_KERNELS", "1") == "0":
        return None
    path = library_path()
    try:
        if not path.exists():
            _compile_once(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("specjax's CPU kernels are not available (%s%s); products use XLA's dots",
                    e, f": {detail.strip()[-500:]}" if detail else "")
        return None
    lib.specjax_cpu_vector.restype = ctypes.c_int
    if not lib.specjax_cpu_vector() and os.environ.get("SPECJAX_CPU_KERNELS") != "1":
        # the scalar loops ran SmolLM2's decode step at a fifth of XLA's dots' speed (an AVX2 CPU before its vector
        # code; docs/benchmarks.md, fifty-ninth session)
        log.warning("specjax's CPU kernels have no vector code for this CPU (neither AVX-512 nor AVX2 + FMA); "
                    "products use XLA's dots (SPECJAX_CPU_KERNELS=1 runs the kernels' scalar loops anyway)")
        return None
    lib.specjax_cpu_set_threads.argtypes = [ctypes.c_int]
    lib.specjax_cpu_threads.restype = ctypes.c_int
    lib.specjax_cpu_amx.restype = ctypes.c_int
    jax.ffi.register_ffi_target("specjax_dense", jax.ffi.pycapsule(lib.SpecjaxDense), platform="cpu")
    jax.ffi.register_ffi_target("specjax_dense_add", jax.ffi.pycapsule(lib.SpecjaxDenseAdd), platform="cpu")
    jax.ffi.register_ffi_target("specjax_unembed", jax.ffi.pycapsule(lib.SpecjaxUnembed), platform="cpu")
    jax.ffi.register_ffi_target("specjax_dense_prompt", jax.ffi.pycapsule(lib.SpecjaxDensePrompt), platform="cpu")
    jax.ffi.register_ffi_target("specjax_paged_attention", jax.ffi.pycapsule(lib.SpecjaxPagedAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target("specjax_argmax", jax.ffi.pycapsule(lib.SpecjaxArgmax), platform="cpu")
    jax.ffi.register_ffi_target("specjax_kv_write", jax.ffi.pycapsule(lib.SpecjaxKvWrite), platform="cpu")
    jax.ffi.register_ffi_target("specjax_take_pages", jax.ffi.pycapsule(lib.SpecjaxTakePages), platform="cpu")
    jax.ffi.register_ffi_target("specjax_rms_norm", jax.ffi.pycapsule(lib.SpecjaxRmsNorm), platform="cpu")
    jax.ffi.register_ffi_target("specjax_rope_qkv", jax.ffi.pycapsule(lib.SpecjaxRopeQkv), platform="cpu")
    lib.specjax_cpu_set_threads(_env_threads())
    return lib


def _env_threads() -> int:
    value = os.environ.get("SPECJAX_CPU_THREADS", "")
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"SPECJAX_CPU_THREADS must be a positive integer, got {value!r}") from None
        if n < 1:
            raise ValueError(f"SPECJAX_CPU_THREADS must be a positive integer, got {value!r}")
        return n
    return _usable_cpus()


def _usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available() -> bool:
    """Whether the kernels are compiled and registered (compiles them on the first call)."""
    return _library() is not None


def set_threads(n: int) -> None:
    """Threads for the kernels' products (1: the calling thread only). Also sets ``SPECJAX_CPU_THREADS`` so that a
    library loaded later starts with it."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    os.environ["SPECJAX_CPU_THREADS"] = str(n)
    lib = _library()
    if lib is not None:
        lib.specjax_cpu_set_threads(n)


def threads() -> int:
    lib = _library()
    return lib.specjax_cpu_threads() if lib is not None else 1


# Whether ``disabled`` is in force: a jit cache key (``jax.make_user_context``), so a function traced inside the
# block is traced anew outside it, nested jitted functions included (``target._layer_call``).
_disabled = jax.make_user_context(default_value=False)


@contextmanager
def disabled():
    """Trace ``layers`` with XLA's own dots (their CPU fallbacks) inside this block, as without a compiler."""
    with _disabled(True):
        yield


def tokens_per_sequence(x) -> int:
    """T of x [..., T, C] (for a 2-D x [rows, C]: its rows)."""
    return x.shape[-2] if x.ndim >= 2 else 1


def supports(x, w) -> bool:
    """Whether a product of x [..., C] with w runs in the kernels on a CPU: one dtype they take (fp32, bf16), or
    fp32 x with bf16 w (the fp32 product with the widened w: a draft head's matrices kept as their bf16 checkpoint
    stores them), at most MAX_TOKENS rows per sequence or (fp32) MAX_PROMPT_ROWS rows in all, or (fp32) any rows
    against a ``PackedWeight``, the kernels built and not ``disabled``. Longer bf16 products (prompt chunks) take
    ``dense_prompt`` against panels (``supports_prompt``), else YNNPACK's (``layers.half_dot``): this kernel's fp32
    fmas over bf16 widened ran a 256-token bf16 prompt at half YNNPACK's rate (forty-fourth session)."""
    few = tokens_per_sequence(x) <= MAX_TOKENS or (x.dtype == w.dtype == jnp.float32 and (
        isinstance(w, PackedWeight) or x.size // max(x.shape[-1], 1) <= MAX_PROMPT_ROWS))
    return ((x.dtype == w.dtype or w.dtype == jnp.bfloat16) and x.dtype in DTYPES and w.ndim >= 2 and x.size > 0
            and few and not _disabled.value and available())


def supports_prompt(x, w) -> bool:
    """Whether a bf16 product that ``supports`` refuses (a prompt chunk) runs in ``dense_prompt``: bf16 x against
    bf16 ``PackedWeight`` panels (``dense.cc``: AMX tiles, AVX512-BF16's dot products, else fp32 fmas over the
    widened panels), the kernels built and not ``disabled``. Elsewhere such a product takes ``layers.half_dot`` of
    the unpacked w. On an AVX2 CPU the widening fmas ran SmolLM2's 30 layers of products for a 64- or 256-token
    bf16 prompt 1.3-1.4x faster than YNNPACK's bf16 dots over [C, O] (docs/benchmarks.md, sixtieth session)."""
    return (isinstance(w, PackedWeight) and x.dtype == w.dtype == jnp.bfloat16 and x.size > 0
            and not _disabled.value and available())


# Columns per panel of a PackedWeight (``dense.cc``'s kPanel).
PANEL = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """An fp32 or bf16 weight w of logical ``shape`` (*C, *O), contracted over its leading axes *C, as ``dense.cc``
    reads it fastest: ``panels`` [O / 32, C, 32] (C = prod(*C), O = prod(*O)), panel p holding columns 32p..32p+31
    of w as [C, O], row after row. A product streams a few panels at a time front to back (one stretch of w per
    thread where [C, O] reads eight rows of w O apart per pass) with the sums of its rows of x in registers; each
    output is the same sequence of fmas, so the same bits as over [C, O] (docs/benchmarks.md, forty-third and
    forty-fourth sessions). ``layers.dense`` takes it (as [C, *O]) where it takes w (bf16 prompt chunks:
    ``dense_prompt``); other products (other platforms, kernels off) read ``unpack()``.
    Made by ``pack`` for the decode layout's fp32 and bf16 matrices on a CPU (``target.decode_layout``)."""
    panels: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    @property
    def rows(self) -> int:
        """C: the rows of w as [C, O]."""
        return self.panels.shape[1]

    def reshape(self, *shape) -> "PackedWeight":
        """The same panels under another logical shape whose leading axes still hold the C rows (``-1`` allowed),
        e.g. ``wo.reshape(N * H, -1)`` of wo [N, H, D]."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if shape.count(-1) == 1:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        if math.prod(shape) != self.size or self.rows not in {math.prod(shape[:k]) for k in range(1, len(shape))}:
            raise ValueError(f"a PackedWeight of shape {self.shape} ({self.rows} rows) cannot take the shape {shape}")
        return PackedWeight(self.panels, tuple(int(d) for d in shape))

    def unpack(self) -> jax.Array:
        """w itself, [C, *O] (a transpose: a copy)."""
        return self.panels.transpose(1, 0, 2).reshape(self.shape)


def packable(w, c_axes: int = 1) -> bool:
    """Whether ``pack`` takes w: a concrete fp32 or bf16 array of 2+ axes whose axes after the first ``c_axes``
    (contracted) hold a multiple of PANEL, the kernels built and not ``disabled``. bf16 panels were once kept to
    CPUs with AVX512-BF16 (their prompts' products); on an AVX2 CPU they stream SmolLM2's bf16 decode products
    1.3x (one row) to 1.5x (eight rows) faster than [C, O] and its prompts' faster than YNNPACK's (sixtieth
    session)."""
    if not isinstance(w, jax.Array) or isinstance(w, jax.core.Tracer) or w.ndim < 2:
        return False
    return _fits_panels(math.prod(w.shape[:c_axes]), math.prod(w.shape[c_axes:]), w.dtype)


def _fits_panels(c: int, o: int, dtype) -> bool:
    return dtype in DTYPES and c > 0 and o > 0 and o % PANEL == 0 and not _disabled.value and available()


def pack_table(table) -> PackedWeight | None:
    """A table [V, D] read as a matrix [D, V] (a tied lm_head: the logits of x [..., D]) as the ``PackedWeight`` of
    that matrix, or None where ``pack`` would not take it (``packable``)."""
    if not isinstance(table, jax.Array) or isinstance(table, jax.core.Tracer) or table.ndim != 2:
        return None
    v, d = table.shape
    return PackedWeight(_table_panels(table), (d, v)) if _fits_panels(d, v, table.dtype) else None


@jax.jit
def _table_panels(table):
    v, d = table.shape
    return table.reshape(v // PANEL, PANEL, d).transpose(0, 2, 1)


def amx() -> bool:
    """Whether bf16 x against bf16 panels (``dense_packed``, ``dense_packed_add``) runs on AMX tiles (``amx.h``: the
    CPU has AMX-BF16 and the OS lends its tiles). Their bits are then the TMUL's sums of 16-row groups, not the
    widening fma chain of the other products (the same for every row count and thread count either way)."""
    lib = _library()
    return lib is not None and bool(lib.specjax_cpu_amx())


def pack(w, c_axes: int = 1) -> PackedWeight:
    """w [*C, *O] (its first ``c_axes`` axes contracted) as a ``PackedWeight`` of w's shape, on w's device. Check
    ``packable`` first."""
    return PackedWeight(_pack_panels(w.reshape(math.prod(w.shape[:c_axes]), -1)), tuple(w.shape))


@jax.jit
def _pack_panels(w2):
    c, o = w2.shape
    return w2.reshape(c, o // PANEL, PANEL).transpose(1, 0, 2)


def _packed_xla(x2, panels):
    return jnp.dot(x2, panels.transpose(1, 0, 2).reshape(panels.shape[1], -1), preferred_element_type=jnp.float32)


def _kernel_product(target: str, out_cols, xla_product, doc: str):
    """A custom call ``target`` (x2 [R, C], w2 -> f32 [R, out_cols(w2)]) made differentiable: its tangents are
    ``xla_product`` (the same product as an XLA dot) of each operand's tangent with the other operand."""
    @jax.custom_jvp
    def product(x2, w2):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], out_cols(w2)), jnp.float32),
                                vmap_method="sequential")(x2, w2)

    @product.defjvp
    def _jvp(primals, tangents):
        (x2, w2), (dx, dw) = primals, tangents
        return product(x2, w2), xla_product(dx, w2) + xla_product(x2, dw)

    product.__doc__ = doc
    return product


dense = _kernel_product(
    "specjax_dense", lambda w2: w2.shape[1], lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
    "x2 [R, C] . w2 [C, O] -> f32 [R, O] (both float32, or w2 bfloat16); differentiable.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def dense_packed(x2, panels, dtype=jnp.float32):
    """x2 [R, C] . the panels [O / 32, C, 32] of a ``PackedWeight`` -> [R, O] in ``dtype`` (float32, or bfloat16:
    the float32 sums rounded, as ``.astype``), both operands float32 or the panels bfloat16; differentiable."""
    out = jax.ShapeDtypeStruct((x2.shape[0], panels.shape[0] * panels.shape[2]), dtype)
    return jax.ffi.ffi_call("specjax_dense", out, vmap_method="sequential")(x2, panels)


@dense_packed.defjvp
def _dense_packed_jvp(dtype, primals, tangents):
    (x2, panels), (dx, dp) = primals, tangents
    return dense_packed(x2, panels, dtype), (_packed_xla(dx, panels) + _packed_xla(x2, dp)).astype(dtype)


@jax.custom_jvp
def dense_packed_add(x2, panels, residual):
    """``residual + dense_packed(x2, panels, residual.dtype)`` (residual [R, O] float32 or bfloat16) in one call, the
    same bits as that sum in XLA (a bf16 sum taken in float32 and rounded): a decoder layer's residual connection
    without a convert and an add of its own; differentiable."""
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    return jax.ffi.ffi_call("specjax_dense_add", out, vmap_method="sequential")(x2, panels, residual)


@dense_packed_add.defjvp
def _dense_packed_add_jvp(primals, tangents):
    (x2, panels, residual), (dx, dp, dr) = primals, tangents
    return (dense_packed_add(x2, panels, residual),
            dr + (_packed_xla(dx, panels) + _packed_xla(x2, dp)).astype(residual.dtype))


dense_prompt = _kernel_product(
    "specjax_dense_prompt", lambda p: p.shape[0] * p.shape[2], _packed_xla,
    "x2 [R, C] bfloat16 . bfloat16 panels [O / 32, C, 32] -> f32 [R, O] by AVX512-BF16's dot products (a bf16 prompt\n"
    "chunk: not ``dense_packed``'s bits); differentiable.")
unembed = _kernel_product(
    "specjax_unembed", lambda t: t.shape[0], lambda x, t: jnp.dot(x, t.T, preferred_element_type=jnp.float32),
    "x2 [R, D] against a table [V, D] -> f32 [R, V] (a tied lm_head); differentiable.")


def supports_attention(q, k_pages, keys_in_pool: bool = False) -> bool:
    """Whether cache attention of q [B, T, N, H] over pools like ``k_pages`` runs in the kernel on a CPU: fp32 or
    bf16 queries and pools, at most MAX_TOKENS new tokens or (a prompt chunk, its keys not ``keys_in_pool``) any
    number, the kernels built and not ``disabled``."""
    return (q.dtype in DTYPES and k_pages.dtype in DTYPES and q.ndim == 4 and q.size > 0
            and (q.shape[1] <= MAX_TOKENS or not keys_in_pool) and not _disabled.value and available())


def paged_attention(q, k, v, mask, k_pages, v_pages, page_table, lengths, layer, sm_scale: float,
                    keys_in_pool: bool):
    """``layers.paged_attention``'s result (f32 [B, T, N, H]) from the kernel ``specjax_paged_attention`` (from 16
    new tokens without ``keys_in_pool``, a prompt chunk, its blocked path): q
    [B, T, N, H]; k, v [B, Tk, K, H] the new keys (read only without ``keys_in_pool``); mask bool[B, T, Tk]; the pools
    [L, P, K, Z, H] (lane-packed or not) read in place at ``layer`` (an int or a traced scalar); page_table
    i32[B, pps]; lengths i32[B]. Not differentiable (no cache is ever differentiated)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call("specjax_paged_attention", out, vmap_method="sequential")
    return call(q, k.astype(q.dtype), v.astype(q.dtype), mask, k_pages, v_pages, page_table.astype(jnp.int32),
                lengths.astype(jnp.int32), jnp.asarray(layer, jnp.int32), sm_scale=np.float32(sm_scale),
                keys_in_pool=np.int64(bool(keys_in_pool)))


def supports_pages(pool) -> bool:
    """Whether pages of a pool like ``pool`` [L, P, K, R, W] are written (``kv_write``) and read (``take_pages``) by
    the kernels on a CPU: fp32 or bf16 pools, the kernels built and not ``disabled``."""
    return pool.dtype in DTYPES and pool.ndim == 5 and pool.size > 0 and not _disabled.value and available()


def kv_write(k_pool, v_pool, k_new, v_new, page, slot, layer):
    """The pools with k_new, v_new [Ln, B, T, K, H] written at layers ``layer`` .. ``layer + Ln - 1`` (an int or a
    traced scalar), page i32[B, T] (an index outside the pool drops the token), slot i32[B, T], from the kernel
    ``specjax_kv_write``: in place when the pools are donated (their only other readers come after the write).
    bf16 pools are written as bf16 (no bits view: a view of a donated pool is a copy of it)."""
    k_new, v_new = k_new.astype(k_pool.dtype), v_new.astype(v_pool.dtype)
    out = (jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
    call = jax.ffi.ffi_call("specjax_kv_write", out, vmap_method="sequential", input_output_aliases={0: 0, 1: 1})
    return call(k_pool, v_pool, k_new, v_new, page.astype(jnp.int32), slot.astype(jnp.int32),
                jnp.asarray(layer, jnp.int32))


def take_pages(pool, cols, layer):
    """The pages ``pool[layer, cols]`` [B, n, K, R, W] of a pool [L, P, K, R, W] (cols i32[B, n], clamped into the
    pool; ``layer`` an int or a traced scalar) from the kernel ``specjax_take_pages``, read in place in any dtype."""
    out = jax.ShapeDtypeStruct((*cols.shape, *pool.shape[2:]), pool.dtype)
    return jax.ffi.ffi_call("specjax_take_pages", out, vmap_method="sequential")(
        pool, cols.astype(jnp.int32), jnp.asarray(layer, jnp.int32))


def supports_argmax(x) -> bool:
    """Whether the argmax over the last axis of x runs in the kernel on a CPU: fp32 logits, the kernels built and not
    ``disabled``."""
    return x.dtype == jnp.float32 and x.ndim >= 1 and x.size > 0 and not _disabled.value and available()


def argmax(x):
    """i32[...] the first index of the largest value along the last axis of fp32 x [..., V] (``jnp.argmax``'s
    answer, NaN included), from the kernel ``specjax_argmax``."""
    v = x.shape[-1]
    out = jax.ShapeDtypeStruct((x.size // v,), jnp.int32)
    return jax.ffi.ffi_call("specjax_argmax", out, vmap_method="sequential")(x.reshape(-1, v)).reshape(x.shape[:-1])


def supports_norm(x, weight) -> bool:
    """Whether ``layers.rms_norm`` of x [..., D] with ``weight`` [D] runs in the kernel on a CPU: fp32 or bf16 x and
    weight, the kernels built and not ``disabled``."""
    return (x.dtype in DTYPES and weight.dtype in DTYPES and weight.ndim == 1 and x.ndim >= 1 and x.size > 0
            and x.shape[-1] == weight.shape[0] and not _disabled.value and available())


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def rms_norm(x2, weight, eps: float, xla_norm):
    """x2 [R, D] RMS-normalised and scaled by ``weight`` [D], in x2's dtype, from the kernel ``specjax_rms_norm``:
    ``xla_norm(x2, weight, eps)`` (``layers.rms_norm``'s XLA program) with an IEEE reciprocal square root, each row's
    bits independent of the others; differentiable (its tangents are ``xla_norm``'s)."""
    out = jax.ShapeDtypeStruct(x2.shape, x2.dtype)
    return jax.ffi.ffi_call("specjax_rms_norm", out, vmap_method="sequential")(x2, weight, eps=np.float32(eps))


@rms_norm.defjvp
def _rms_norm_jvp(eps, xla_norm, primals, tangents):
    return rms_norm(*primals, eps, xla_norm), jax.jvp(lambda x, w: xla_norm(x, w, eps), primals, tangents)[1]


def supports_rope(qkv) -> bool:
    """Whether ``layers.rope_qkv`` of a fused projection's output qkv [..., T, K, G + 2, H] runs in the kernel on a
    CPU: fp32 or bf16, any number of tokens (a decode step, a tree, a prompt chunk), H even and <= 512, the kernels
    built and not ``disabled``."""
    return (qkv.dtype in DTYPES and qkv.ndim >= 4 and qkv.size > 0 and qkv.shape[-2] >= 3
            and qkv.shape[-1] % 2 == 0 and qkv.shape[-1] <= 512 and not _disabled.value and available())


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def rope_qkv(qkv4, cos, sin, xla_rope):
    """(q [R, K*G, H], k [R, K, H], v [R, K, H]) of qkv4 [R, K, G + 2, H] with q and k rotated by cos, sin f32
    [R, H/2], in qkv4's dtype, from the kernel ``specjax_rope_qkv``: the bits of ``xla_rope(qkv4, cos, sin)``
    (``layers.rope_qkv``'s XLA program); differentiable (its tangents are ``xla_rope``'s)."""
    r, kv, g2, h = qkv4.shape
    out = (jax.ShapeDtypeStruct((r, kv * (g2 - 2), h), qkv4.dtype), jax.ShapeDtypeStruct((r, kv, h), qkv4.dtype),
           jax.ShapeDtypeStruct((r, kv, h), qkv4.dtype))
    return tuple(jax.ffi.ffi_call("specjax_rope_qkv", out, vmap_method="sequential")(
        qkv4, cos.astype(jnp.float32), sin.astype(jnp.float32)))


@rope_qkv.defjvp
def _rope_qkv_jvp(xla_rope, primals, tangents):
    return rope_qkv(*primals, xla_rope), jax.jvp(xla_rope, primals, tangents)[1]
