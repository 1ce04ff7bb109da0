"""specjax.host.reuse_cpu_temps: sync dispatch and glibc's heap settings for CPU CLIs (a subprocess: both are
process-wide)."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import jax, jax.numpy as jnp
from specjax.host import reuse_cpu_temps
applied = reuse_cpu_temps()
x = jnp.ones((1024, 1024))
for _ in range(3):
    x = (x @ x) / 1024.0   # programs with temporaries, run several times
print(applied, jax.config.values["jax_cpu_enable_async_dispatch"], float(x[0, 0]))
"""


def _probe(**env):
    e = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator settings are glibc's")
def test_applied_on_a_cpu_host():
    applied, async_dispatch, value = _probe()
    assert applied == "True" and async_dispatch == "False" and float(value) == 1.0


def test_opt_out():
    applied, async_dispatch, value = _probe(SPECJAX_CPU_HEAP="0")
    assert applied == "False" and async_dispatch == "True" and float(value) == 1.0
