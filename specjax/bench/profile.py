"""Where a device's time goes: a ``jax.profiler`` trace of one call, summarised per kernel.

``trace_call(fn, log_dir)`` runs ``fn()`` under ``jax.profiler.trace`` (with a perfetto trace, Chrome's JSON format)
and returns the trace file; ``summarize(path, units)`` reads the events a device recorded (the processes named
``/device:...``: a GPU's streams' kernels and copies, a TPU's XLA operations) and returns, per ``unit`` (a decoded
token, a step), the device's busy time (the union of its events), the span from its first event to its last end,
and the kernels that took the most time. ``busy / span`` below 1 is time the device sat idle between kernels
(launches, host syncs, a ``while_loop``'s condition read back), the rest is the kernels' own time. A CPU has no
device events (XLA:CPU's work runs on host threads), so there ``summarize`` raises ``ValueError``; instead, for the
programs compiled after ``enable_cpu_op_events()``, XLA:CPU records one host event per operation it runs, and
``summarize_ops`` groups them by what each operation is (``hlo_op_kinds`` of the program's optimized HLO:
``specjax_dense f32[8,3072]``, ``fusion f32[8,1536]``). ``summarize_program`` takes whichever the trace holds.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

from specjax.bench.common import print_table


def trace_call(fn, log_dir: str) -> str:
    """Run ``fn()`` under the JAX profiler (blocking on its result); returns the perfetto trace file it wrote."""
    import jax
    os.makedirs(log_dir, exist_ok=True)
    before = set(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    new = set(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))) - before
    if not new:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {log_dir}")
    return max(new, key=os.path.getmtime)


# XLA's flag for an event per operation of a CPU program (its thunks), read from XLA_FLAGS as each program compiles.
CPU_OP_EVENTS_FLAG = "--xla_cpu_enable_xprof_traceme=true"
_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\(")
_CONTROL_FLOW = {"while", "conditional", "call"}  # their events span their bodies' operations, counted themselves


def enable_cpu_op_events() -> None:
    """Have XLA:CPU record an event per operation in ``jax.profiler`` traces (``CPU_OP_EVENTS_FLAG``) for the programs
    compiled from now on (in XLA_FLAGS, which each compile reads); no effect on other devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_OP_EVENTS_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_OP_EVENTS_FLAG}".strip()


def hlo_op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> what it is, for every instruction of an optimized HLO module's text: a custom call as its
    target and result shape (``specjax_dense f32[8,3072]``), any other operation as its opcode and result shape."""
    kinds = {}
    for line in hlo_text.splitlines():
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line) if op == "custom-call" else None
        kinds[name] = f"{target.group(1) if target else op} {re.sub(r'{[^}]*}', '', shape)}"
    return kinds


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def device_events(trace: dict) -> tuple[str, list[dict]]:
    """The complete ('X') events of the trace's device processes (names starting ``/device:``), and those names."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "pid" in e}
    device_pids = {pid for pid, name in procs.items() if str(name).startswith("/device:")}
    if not device_pids:
        raise ValueError(f"no device in the trace (processes: {sorted(set(procs.values()))}); on a CPU, XLA's work "
                         f"runs on host threads")
    xs = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]
    # A GPU's 'XLA Modules' / 'XLA Ops' lines span the kernels of its stream lines, so one line kind is read, or
    # every kernel would count two or three times: the streams (a GPU's kernels and copies), else 'XLA Ops' (a TPU's
    # operations), else every line but the modules and steps that span them.
    threads = {(e["pid"], e.get("tid")): str(e["args"]["name"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in device_pids}
    keep = ({k for k, name in threads.items() if name.startswith("Stream")}
            or {k for k, name in threads.items() if name == "XLA Ops"})
    if keep:
        xs = [e for e in xs if (e["pid"], e.get("tid")) in keep]
    else:
        spans = {k for k, name in threads.items() if name.startswith(("XLA Modules", "Steps", "Framework"))}
        xs = [e for e in xs if (e["pid"], e.get("tid")) not in spans]
    return ", ".join(sorted(procs[p] for p in device_pids)), xs


def _load(paths: str | list[str], units: int) -> list[tuple[str, dict]]:
    """(path, parsed trace) of each of ``paths``, read once."""
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    out = []
    for path in [paths] if isinstance(paths, str) else paths:
        with gzip.open(path, "rt") as f:
            out.append((path, json.load(f)))
    return out


def _device_summary(traces: list[tuple[str, dict]], units: int, top: int) -> dict:
    per_trace = []
    for path, trace in traces:
        device, xs = device_events(trace)
        if not xs:
            raise ValueError(f"no device events in the trace at {path} ({device}); on a CPU, XLA's work runs on "
                             f"host threads")
        per_trace.append(xs)
    return _per_unit(device, per_trace, units, top, lambda e: str(e.get("name", "?")))


def _ops_summary(traces: list[tuple[str, dict]], units: int, kinds: dict[str, str], top: int) -> dict:
    per_trace = []
    for path, trace in traces:
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        xs = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("name") in kinds
              and kinds[e["name"]].split(" ")[0] not in _CONTROL_FLOW]
        if not xs:
            raise ValueError(f"no XLA:CPU operation events in the trace at {path}: compile the program after "
                             f"enable_cpu_op_events() (XLA_FLAGS {CPU_OP_EVENTS_FLAG})")
        per_trace.append(xs)
    return _per_unit("XLA:CPU operations on host threads", per_trace, units, top, lambda e: kinds[e["name"]])


def summarize(paths: str | list[str], units: int, top: int = 15) -> dict:
    """Per-``unit`` device time of the perfetto trace at ``paths`` (see the module doc); of several traces of the
    same program (``units`` in all), their times added (each trace's busy time and span its own)."""
    return _device_summary(_load(paths, units), units, top)


def _per_unit(device: str, traces: list[list[dict]], units: int, top: int, key) -> dict:
    """The summary of ``summarize`` over the events of each trace, grouped by ``key(event)``: busy time (the union of
    a trace's events) and span (its first start to its last end) added over the traces."""
    busy = span = 0.0
    by_name: dict[str, list[float]] = {}
    for xs in traces:
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in xs]
        busy += _union_us(spans)
        span += max(e for _, e in spans) - min(s for s, _ in spans)
        for e in xs:
            by_name.setdefault(key(e), []).append(float(e["dur"]))
    total = sum(sum(d) for d in by_name.values())
    kernels = sorted(((name, len(d), sum(d)) for name, d in by_name.items()), key=lambda r: -r[2])
    events = sum(len(xs) for xs in traces)
    return {"device": device, "units": units, "events": events, "events_per_unit": events / units,
            "busy_ms_per_unit": busy / units / 1e3, "span_ms_per_unit": span / units / 1e3,
            "busy_fraction": busy / span if span > 0 else 1.0, "distinct_kernels": len(kernels),
            "top": [{"name": name, "calls_per_unit": n / units, "ms_per_unit": t / units / 1e3,
                     "share": t / total if total > 0 else 0.0} for name, n, t in kernels[:top]]}


def summarize_ops(paths: str | list[str], units: int, kinds: dict[str, str], top: int = 15) -> dict:
    """Per-``unit`` time of the XLA:CPU operations in the traces at ``paths`` (of one program, ``units`` in all),
    grouped by ``kinds`` (``hlo_op_kinds`` of the program): the host events named as its instructions
    (``enable_cpu_op_events``), control flow (while, conditional, call) left out, as its bodies' operations count
    themselves."""
    return _ops_summary(_load(paths, units), units, kinds, top)


def summarize_program(paths: str | list[str], units: int, hlo_text: str, top: int = 15) -> dict:
    """``summarize`` where the traces hold device events, else ``summarize_ops`` over the program ``hlo_text`` (the
    traces read once)."""
    traces = _load(paths, units)
    try:
        return _device_summary(traces, units, top)
    except ValueError as device_error:
        try:
            return _ops_summary(traces, units, hlo_op_kinds(hlo_text), top)
        except ValueError as ops_error:
            raise ValueError(f"{device_error}; {ops_error}") from None


def print_summary(s: dict, unit: str = "token", title: str = "device trace") -> None:
    print(f"\n{title}, {s['device']}: per {unit}, {s['events_per_unit']:.0f} device events, busy "
          f"{s['busy_ms_per_unit']:.3f} ms of a {s['span_ms_per_unit']:.3f} ms span ({100 * s['busy_fraction']:.1f}% "
          f"busy; the rest is the device idle between kernels), {s['distinct_kernels']} distinct kernels; the top "
          f"{len(s['top'])}:\n")
    print_table(["kernel", f"calls / {unit}", f"ms / {unit}", "share of kernel time"],
                [[k["name"][:90], f"{k['calls_per_unit']:.1f}", f"{k['ms_per_unit']:.3f}", f"{100 * k['share']:.1f}%"]
                 for k in s["top"]])
