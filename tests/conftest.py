"""Test setup: 16 fake CPU devices (set before JAX initialises) and fp32 matmul precision for parity checks."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(session, config, items):
    """The TPU preflight tests run last: they load libtpu into this process and compile for TPU topologies, and
    XLA:CPU compiles that came after them in the same process crashed (segfault in a later speculative_generate
    compile, jax 0.10.2). Run last, nothing compiles for the CPU after them."""
    items.sort(key=lambda item: "test_preflight" in item.nodeid)
