"""Process-level settings for a CPU host that runs large XLA programs many times (the trainer, ``bench train``).

XLA:CPU allocates a program's temporaries as one buffer per call: 565 MB for the TTT rollout's value-and-grad of a
SmolLM2 bf16 training step. glibc serves an allocation that large with a fresh ``mmap`` and unmaps it on free, so
every call faulted all of its pages in again: 147 k page faults per call, about a fifth of the step's CPU time in
the kernel (docs/benchmarks.md, thirty-eighth session). ``reuse_cpu_temps`` makes the buffer outlive the call:
- dispatch on a CPU is synchronous, so the thread that calls the program (the main thread) allocates its buffer, from
  glibc's main arena (with asynchronous dispatch a worker thread allocates it, from an arena of its own, where glibc
  maps large blocks whatever its settings say);
- glibc serves large blocks from the heap instead of ``mmap`` and does not trim the heap, so a freed buffer is reused
  by the next call.
The SmolLM2 bf16 train step ran 10-18% faster (fp32 9%). Memory the process frees stays with it (its peak, as
before). Not for servers: asynchronous dispatch lets their host work run beside the device's.

And what the host is: ``cpu_model`` and ``cpu_flags`` (named beside every measured figure, and compared with the
machine a head's tree table was tuned on), ``device_bytes_limit`` (an accelerator's memory, which the server sizes its
KV pool from) and ``available_host_bytes`` (what a CPU can still hold).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import jax

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo; the platform's processor string elsewhere)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def device_bytes_limit() -> int | None:
    """Memory of one device as the runtime reports it (None on CPU, which has no device limit)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends may raise instead of returning None
        stats = None
    return (stats or {}).get("bytes_limit") or None


def available_host_bytes() -> int | None:
    """The host memory the kernel says is available (``MemAvailable`` of /proc/meminfo); None where it is unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it is not available)."""
    return set((_cpuinfo("flags") or "").split())


VECTOR_EXTENSIONS = ("AVX-512", "AVX2")  # as ``cpu_vector_extension`` names them, widest first


def cpu_vector_extension() -> str | None:
    """The widest vector extension specjax's CPU kernels have code for on this CPU: "AVX-512", "AVX2" (with FMA),
    or None. CPUs of one model name differ in it (an "AMD EPYC" is a Zen 1 with AVX2 or a Zen 4 with AVX-512), and
    with it in the step costs of a tree table (docs/benchmarks.md, fifty-ninth and sixtieth sessions)."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return VECTOR_EXTENSIONS[0]
    return VECTOR_EXTENSIONS[1] if {"avx2", "fma"} <= flags else None


def reuse_cpu_temps() -> bool:
    """Apply the settings above when this process computes on a CPU under glibc; call it before the first jax
    computation (the dispatch mode is fixed when jax creates its CPU client). ``SPECJAX_CPU_HEAP=0`` turns it off.
    Returns whether the allocator settings were applied."""
    if os.environ.get("SPECJAX_CPU_HEAP", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # only the CPU client reads it
    if jax.default_backend() != "cpu":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False
