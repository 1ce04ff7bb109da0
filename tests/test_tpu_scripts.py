"""tpu_scripts/: every script parses (bash -n), and env.sh's helpers say what the scripts rely on: how many hosts a
slice has (serve.sh refuses a multi-host VM, whose one-host server would wait at TPU start-up for the others), where
the local preflight finds a config given from the checkout's root, and how a remote path keeps its ~/."""

import glob
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tpu_scripts")


def _bash(script: str) -> str:
    """``script`` run by bash in tpu_scripts/ after sourcing env.sh (PROJECT set: no gcloud is asked)."""
    r = subprocess.run(["bash", "-c", f"set -euo pipefail; PROJECT=p; source ./env.sh; {script}"], cwd=SCRIPTS,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(SCRIPTS, "*.sh"))), ids=os.path.basename)
def test_scripts_parse(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_env_helpers():
    hosts = {a: _bash(f"slice_hosts {a}").strip() for a in ("v4-8", "v4-32", "v5p-16", "v5litepod-16", "''")}
    assert hosts == {"v4-8": "1", "v4-32": "4", "v5p-16": "2", "v5litepod-16": "1", "''": "1"}
    assert _bash("local_config configs/qwen2.5-7b.yaml") == "../configs/qwen2.5-7b.yaml"
    assert _bash("local_config qwen2.5-7b.yaml") == "qwen2.5-7b.yaml"
    assert _bash("remote_path '~/heads/a b'") == "~/heads/a\\ b"
    # create.sh's optional flags: an empty array under `set -u` (bash < 4.4 called it unbound) expands to nothing
    assert _bash('extra=(); printf "[%s]" ${extra[@]+"${extra[@]}"} x') == "[x]"
