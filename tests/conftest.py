"""Test setup: 16 fake CPU devices (set before JAX initialises) and fp32 matmul precision for parity checks."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each executable's machine code into memory:
    one pytest process that keeps the programs of the whole suite passes Linux's default limit of 65530 memory maps
    (vm.max_map_count) part way through and aborts inside the next compile (seen as segfaults / aborts in
    backend_compile late in the suite). Modules do not share compiled programs, so this costs no recompiles."""
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(session, config, items):
    """Order: tests/test_spec_trained_head.py first (its compile is the largest), the TPU preflight tests (libtpu in
    this process) last."""
    def key(item):
        return (0 if "test_spec_trained_head" in item.nodeid else 2 if "test_preflight" in item.nodeid else 1)
    items.sort(key=key)
