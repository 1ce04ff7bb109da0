"""Platform-specific code paths, traced only for the platform a program is lowered for.

``jax.lax.platform_dependent`` stages every branch into the program and picks one when lowering. specjax's CPU
programs carry a kernel branch and an XLA branch in every layer (products, norms, the rotary embedding, attention,
the K/V writes), so tracing them cost twice the work, and that tracing was most of a new program's start-up after
its compile (docs/benchmarks.md, thirty-fifth session). ``select`` traces one branch: the one for the platform the
program is being lowered for, which is this process's default backend unless ``lowering_for`` names another (the
TPU preflight lowers TPU programs on a CPU host). The platform is a jit cache key, so a function traced for one
platform is traced anew for another. Where it is not known which branch applies (an accelerator other than CPU or
TPU with per-platform branches of its own), every branch is staged as ``platform_dependent`` does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
from jax._src import xla_bridge

# The platform programs are lowered for, when it is not the default backend's (``lowering_for``).
_LOWERING = jax.make_user_context(default_value=None)
_KNOWN = frozenset({"cpu", "tpu"})  # default backends whose branch name is the backend name
# SGLang's --device names -> (the JAX platform to ask for, the name jax.default_backend() then gives)
_DEVICES = {"cpu": ("cpu", "cpu"), "cuda": ("cuda", "gpu"), "gpu": ("cuda", "gpu"), "tpu": ("tpu", "tpu")}


def use_device(device: str | None) -> None:
    """Run this process's JAX programs on ``device`` (SGLang's ``--device``: cpu, cuda / gpu, tpu; None: JAX's own
    choice). Before JAX has started a backend this selects the platform; after it, the device must be the one
    already in use. A ValueError says what is missing."""
    if device is None:
        return
    if device not in _DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(_DEVICES)}")
    platform, backend = _DEVICES[device]
    if xla_bridge.backends_are_initialized():
        if jax.default_backend() != backend:
            raise ValueError(f"device {device!r} asked for, but this process already runs JAX on "
                             f"{jax.default_backend()!r}; choose the device before anything runs on another")
        return
    before = jax.config.jax_platforms
    jax.config.update("jax_platforms", platform)
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError, or AssertionError when no backend starts
        jax.config.update("jax_platforms", before)  # as it was (JAX_PLATFORMS, or JAX's own choice)
        hint = {"cuda": " (install jax[cuda12])", "tpu": " (install jax[tpu] on a TPU host)"}.get(platform, "")
        raise ValueError(f"device {device!r}: JAX has no {platform} backend here{hint}"
                         + (f": {e}" if str(e) else "")) from None


@contextlib.contextmanager
def lowering_for(platform: str):
    """Within this block, programs are traced for ``platform`` (e.g. "tpu" for a TPU topology's devices)."""
    with _LOWERING(platform):
        yield


def lowering_platform() -> str:
    """The platform the programs traced now are lowered for: ``lowering_for``'s, else the default backend."""
    return _LOWERING.value or jax.default_backend()


def select(*args: Any, default: Callable, **per_platform: Callable):
    """``per_platform[p](*args)`` for the lowering platform p, or ``default(*args)`` where it has no branch (the
    contract of ``jax.lax.platform_dependent``, with one branch traced)."""
    platform = lowering_platform()
    if platform in _KNOWN or per_platform.keys() <= _KNOWN:
        return per_platform.get(platform, default)(*args)
    return jax.lax.platform_dependent(*args, default=default, **per_platform)
