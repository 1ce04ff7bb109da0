"""Test setup: 16 fake CPU devices (set before JAX initialises) and fp32 matmul precision for parity checks."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
# The suite's time is mostly XLA:CPU compiles of small programs (about 70% of it, measured), not their execution.
# Without LLVM's optimisations and with the classic fusion emitters, tests/test_spec_runner.py compiled in 29 s
# instead of 96 s and the whole suite ran in a quarter of the time. The same HLO is compiled; only the machine code
# differs (last-bit differences: without LLVM's optimisations, a row of a batched product is not always bitwise the
# one-row product). Tests marked ``xla_defaults`` make claims about the code XLA emits by default and run in a child
# process without these flags (below). Tests marked ``xla_default_hlo`` make claims about the optimized HLO only
# (copies, in-place writes): their child keeps LLVM's optimisations off, which XLA's HLO passes do not read (the
# optimized HLO of the fp32 and bf16 decode and server steps compared equal line for line, and the file's HLO tests
# ran in 50 s instead of 71). SPECJAX_TEST_XLA_DEFAULTS=1 runs the whole suite with XLA's defaults.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
DEFAULTS_MODES = {"xla_defaults": ("1", ()), "xla_default_hlo": ("hlo", FAST_COMPILE_FLAGS[:1])}  # marker: env, flags
_KEPT_FLAGS = dict(DEFAULTS_MODES.values())  # SPECJAX_TEST_XLA_DEFAULTS: the fast-compile flags that child keeps
_XLA_MODE = os.environ.get("SPECJAX_TEST_XLA_DEFAULTS", "")
FAST_COMPILE = _XLA_MODE not in _KEPT_FLAGS
for _flag in FAST_COMPILE_FLAGS if FAST_COMPILE else _KEPT_FLAGS[_XLA_MODE]:
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# specjax's CPU kernels on the calling thread only: two pytest workers share this machine's cores, and a pool thread
# spinning for work would take a core from the other worker. tests/test_cpu_dense.py runs the pool itself.
os.environ.setdefault("SPECJAX_CPU_THREADS", "1")
# The kernels run wherever they build: a CPU without their vector code (neither AVX-512 nor AVX2 + FMA) would
# otherwise leave them off (``cpu_dense._library``), and the suite pins their results everywhere.
os.environ.setdefault("SPECJAX_CPU_KERNELS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CLIs keep compiled programs across runs (``hub.enable_compilation_cache``); tests (and the CLIs they start in
# child processes) compile afresh unless they name a JAX_COMPILATION_CACHE_DIR themselves, so that what a test counts
# or times is its own compile.
os.environ.setdefault("SPECJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from xml.etree import ElementTree  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def cpu_kernels():
    """specjax's CPU kernels built (the test module fails if they are not); their thread count restored after."""
    from specjax.kernels import cpu_dense
    assert cpu_dense.available(), "the kernels failed to build (see the specjax log warning)"
    before = cpu_dense.threads()
    yield
    cpu_dense.set_threads(before)


@pytest.fixture
def default_precision():
    """JAX's default matmul precision, as the CLIs run, instead of the suite's "highest" (for parity checks). The TPU
    preflight compiles what the server and trainer would: at "highest" every fp32 product is emulated in several bf16
    passes, which doubled the TPU compile times and is not the program a user runs."""
    with jax.default_matmul_precision(None):
        yield


@pytest.fixture(scope="module")
def v5e():
    """An abstract v5e-4 (libtpu) for the server preflight tests; they skip with the reason without libtpu."""
    from preflight_helpers import topology
    return topology("v5e-4")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each executable's machine code into memory:
    one pytest process that keeps the programs of the whole suite passes Linux's default limit of 65530 memory maps
    (vm.max_map_count) part way through and aborts inside the next compile (seen as segfaults / aborts in
    backend_compile late in the suite). Modules do not share compiled programs, so this costs no recompiles."""
    yield
    jax.clear_caches()


# The test modules that take longest (seconds of one worker, both workers busy on 2 cores), longest first. The two
# pytest workers take whole files (``--dist loadfile``) in collection order, so these start first and the short
# modules fill in at the end: the workers finish within seconds of each other. (xdist's own order, by test count,
# handed out three of the longest files last and left one worker idle for up to two minutes.)
LONGEST_FIRST = ("test_preflight_kv_pool", "test_shipped_head", "test_train_resume", "test_decode_layout",
                 "test_real_model_sampling", "test_spec_runner", "test_regenerate", "test_preflight",
                 "test_spec_greedy", "test_multihost", "test_server_bad_input", "test_server_spec",
                 "test_preflight_serve", "test_offline")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Order: the modules of LONGEST_FIRST in that order, then the others as collected."""
    def key(item):
        module = item.path.stem
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=key)


_DEFAULTS_RESULTS: dict[str, tuple[str, str]] = {}


def _run_with_xla_defaults(items, rootpath, marker: str) -> None:
    """Run ``items`` in one child pytest with XLA's default compiler flags (``DEFAULTS_MODES[marker]``: all of them, or
    all but LLVM's optimisations); record each one's outcome."""
    mode, flags = DEFAULTS_MODES[marker]
    env = dict(os.environ, SPECJAX_TEST_XLA_DEFAULTS=mode)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f not in FAST_COMPILE_FLAGS or f in flags)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               f"--junitxml={report}", *(it.nodeid for it in items)]
        proc = subprocess.run(cmd, cwd=rootpath, env=env, capture_output=True, text=True, timeout=1800)
        cases = ElementTree.parse(report).getroot().iter("testcase") if os.path.exists(report) else ()
        outcomes = {}
        for case in cases:
            bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
            outcome = "PASSED" if not bad else "SKIPPED" if bad[0].tag == "skipped" else "FAILED"
            outcomes[(case.get("classname"), case.get("name"))] = (outcome, bad[0].get("message", "") if bad else "")
    out = proc.stdout + proc.stderr
    for it in items:
        path, *scope = it.nodeid.split("::")
        classname = ".".join([path.removesuffix(".py").replace("/", "."), *scope[:-1]])
        outcome, message = outcomes.get((classname, scope[-1]), ("NOT RUN", ""))
        _DEFAULTS_RESULTS[it.nodeid] = (outcome, message if outcome == "SKIPPED" else out)


def _defaults_marker(item) -> str | None:
    return next((m for m in DEFAULTS_MODES if item.get_closest_marker(m) is not None), None)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """``xla_defaults`` / ``xla_default_hlo`` tests under the suite's fast-compile flags: the module's tests with the
    same marker run once, together, in a child process with XLA's defaults (see FAST_COMPILE_FLAGS); each test here
    reports its outcome there."""
    marker = _defaults_marker(pyfuncitem)
    if not FAST_COMPILE or marker is None:
        return None
    if pyfuncitem.nodeid not in _DEFAULTS_RESULTS:
        mates = [it for it in pyfuncitem.session.items if it.module is pyfuncitem.module
                 and _defaults_marker(it) == marker and it.nodeid not in _DEFAULTS_RESULTS]
        _run_with_xla_defaults(mates, pyfuncitem.config.rootpath, marker)
    outcome, out = _DEFAULTS_RESULTS.pop(pyfuncitem.nodeid)
    if outcome == "SKIPPED":
        pytest.skip(f"with XLA's default flags (child process): {out}")
    if outcome != "PASSED":
        pytest.fail(f"{outcome} with XLA's default compiler flags (child process):\n{out[-6000:]}", pytrace=False)
    return True
