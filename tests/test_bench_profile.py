"""bench.profile: a device trace summarised per kernel (union of busy time, span, top kernels)."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from specjax.bench.profile import (_union_us, enable_cpu_op_events, hlo_op_kinds, summarize, summarize_ops,
                                   summarize_program, trace_call)


def _write(tmp_path, events):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def _meta(pid, name, tid=None, kind="process_name"):
    e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def test_union_of_overlapping_intervals():
    assert _union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert _union_us([]) == 0


def test_summary_counts_stream_kernels_once_per_unit(tmp_path):
    events = [_meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
              _meta(2, "Stream #13(Compute)", tid=13, kind="thread_name"),
              _meta(2, "XLA Ops", tid=99, kind="thread_name")]
    # two tokens: each a 30 us gemv and a 10 us add, with 10 us idle between kernels; the XLA Ops line repeats them
    t = 0.0
    for _ in range(2):
        for name, dur in (("gemv_bf16", 30.0), ("add_fusion", 10.0)):
            events.append({"ph": "X", "pid": 2, "tid": 13, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 2, "tid": 99, "ts": t, "dur": dur, "name": "op." + name})
            t += dur + 10.0
    events.append({"ph": "X", "pid": 1, "tid": 5, "ts": 0.0, "dur": 500.0, "name": "host work"})
    s = summarize(_write(tmp_path, events), units=2)
    assert s["device"] == "/device:GPU:0" and s["events_per_unit"] == 2
    assert s["busy_ms_per_unit"] == pytest.approx(0.040)
    assert s["span_ms_per_unit"] == pytest.approx(0.055)  # 110 us from the first start to the last end, over 2
    assert s["busy_fraction"] == pytest.approx(80 / 110)
    assert [k["name"] for k in s["top"]] == ["gemv_bf16", "add_fusion"]
    assert s["top"][0]["share"] == pytest.approx(0.75) and s["top"][0]["calls_per_unit"] == 1


def test_tpu_trace_reads_its_xla_ops_line(tmp_path):
    events = [_meta(3, "/device:TPU:0"), _meta(3, "XLA Modules", tid=1, kind="thread_name"),
              _meta(3, "XLA Ops", tid=2, kind="thread_name")]
    events.append({"ph": "X", "pid": 3, "tid": 1, "ts": 0.0, "dur": 100.0, "name": "jit_step"})
    events += [{"ph": "X", "pid": 3, "tid": 2, "ts": t, "dur": 20.0, "name": "fusion.1"} for t in (0.0, 50.0)]
    s = summarize(_write(tmp_path, events), units=1)
    assert s["events"] == 2 and s["busy_ms_per_unit"] == pytest.approx(0.040)
    assert s["span_ms_per_unit"] == pytest.approx(0.070)


def test_device_without_events_is_said(tmp_path):
    path = _write(tmp_path, [_meta(4, "/device:CPU:0"), _meta(1, "/host:CPU")])
    with pytest.raises(ValueError, match=r"no device events in the trace at .* \(/device:CPU:0\); on a CPU"):
        summarize(path, units=1)


def test_cpu_trace_has_no_device(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    path = trace_call(lambda: f(x), str(tmp_path / "trace"))
    with pytest.raises(ValueError, match="no device"):
        summarize(path, units=1)
    with pytest.raises(ValueError, match="units"):
        summarize(path, units=0)


def test_cpu_operations_are_grouped_by_what_they_are(tmp_path):
    """On a CPU the trace's host events named as the program's instructions are its operations: grouped by custom-call
    target (or opcode) and result shape, a while loop's own event left out (its body's operations count)."""
    hlo = "\n".join([
        'ENTRY %main {',
        '  %ffi_call.1 = f32[8,3072]{1,0} custom-call(f32[8,576]{1,0} %x), custom_call_target="specjax_dense"',
        '  %ffi_call.2 = f32[8,3072]{1,0} custom-call(f32[8,576]{1,0} %x), custom_call_target="specjax_dense"',
        '  %ffi_call.3 = (f32[8,9,64]{2,1,0}, f32[8,3,64]{2,1,0}) custom-call(%q), custom_call_target="specjax_rope"',
        '  %while.4 = (s32[], f32[4]{0}) while(%t), condition=%c, body=%b',
        '  ROOT %fusion.5 = f32[8,1536]{1,0} fusion(%a, %b), kind=kLoop, calls=%f',
        '}'])
    kinds = hlo_op_kinds(hlo)
    assert kinds["ffi_call.1"] == kinds["ffi_call.2"] == "specjax_dense f32[8,3072]"
    assert kinds["ffi_call.3"] == "specjax_rope (f32[8,9,64], f32[8,3,64])"
    assert kinds["fusion.5"] == "fusion f32[8,1536]" and kinds["while.4"].startswith("while ")
    events = [_meta(1, "/host:CPU")]
    for step in range(2):  # per step: the two products (30 + 10 us), the rope (5), the fusion (5), in a while (100)
        t = step * 200.0
        events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 100.0, "name": "while.4"})
        for name, dur in (("ffi_call.1", 30.0), ("ffi_call.2", 10.0), ("ffi_call.3", 5.0), ("fusion.5", 5.0)):
            events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": dur, "name": name})
            t += dur + 2.0
        events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 99.0, "name": "ThunkExecutor::Execute"})
    path = _write(tmp_path, events)
    s = summarize_ops(path, 2, kinds)
    assert s["events_per_unit"] == 4 and s["busy_ms_per_unit"] == pytest.approx(0.050)
    assert [(k["name"], k["calls_per_unit"]) for k in s["top"]] == [
        ("specjax_dense f32[8,3072]", 2), ("specjax_rope (f32[8,9,64], f32[8,3,64])", 1), ("fusion f32[8,1536]", 1)]
    assert s["top"][0]["ms_per_unit"] == pytest.approx(0.040)
    assert summarize_program(path, 2, hlo)["top"] == s["top"]  # no device events: the operations
    # two traces of the program (rounds in turns with another): their times and calls add, each its own span
    later = [dict(e, ts=e["ts"] + 1e6) if e.get("ph") == "X" else e for e in events]
    both = summarize_ops([path, _write(tmp_path / "b", later)], 4, kinds)
    assert both["top"] == s["top"] and both["busy_ms_per_unit"] == pytest.approx(0.050)
    assert both["span_ms_per_unit"] == pytest.approx(s["span_ms_per_unit"])  # not the 1 s between the traces
    with pytest.raises(ValueError, match="no device.*enable_cpu_op_events"):
        summarize_program(path, 2, "")


def test_spec_phase_times_profile_where_a_step_goes(tmp_path, capsys, monkeypatch):
    """``bench spec --profile-dir`` (``phase_times(..., profile_dir)``): the fused and the plain step traced and
    summarised per XLA:CPU operation (XLA's flag set as the bench sets it, before the programs compile; restored for
    the other tests), and printed after the phase table."""
    from spec_models import random_models, tiny_config

    from specjax.bench.spec import phase_times, print_spec_table
    from specjax.kernels.tree_attention import make_cache_attention
    from specjax.speculative import draft as draft_lib, spec_step as step_lib
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    enable_cpu_op_events()
    cfg = tiny_config()
    tp, (e3cfg, e3, d2t) = random_models(cfg)[:2]
    draft = draft_lib.make_draft("EAGLE3", e3cfg, e3, tp, d2t)
    scfg = step_lib.SpecConfig(2, 1, 3, make_cache_attention("auto"), sampling=False)
    times, profiles = phase_times(tp, cfg, draft, scfg, [1, 5, 9, 4, 7], 2, str(tmp_path / "prof"))
    assert set(profiles) == {"fused_step", "plain_decode_step"} and times["fused_step"] > 0
    for name, s in profiles.items():
        assert s["device"] == "XLA:CPU operations on host threads" and s["path"].startswith(str(tmp_path / "prof"))
        assert s["top"] and s["busy_ms_per_unit"] <= s["span_ms_per_unit"], s
    print_spec_table(dict(model="m", draft="d", prompts="p", max_new_tokens=1, num_steps=2, topk=1, num_draft_tokens=3,
                          plain_tokens=1, plain_tok_s=1.0, algorithm="EAGLE3", spec_tokens=1, spec_tok_s=1.0,
                          speedup=1.0, tau=1.0, identical_outputs="1/1",
                          phases_ms={k: v * 1e3 for k, v in times.items()}, profiles=profiles))
    lines = capsys.readouterr().out.splitlines()
    for name in ("fused step", "plain decode step"):
        i = next(i for i, x in enumerate(lines) if x.startswith(name + " ("))
        assert "XLA:CPU operations on host threads: per step" in lines[i]
        assert lines[i + 2].startswith("| kernel | calls / step |") and lines[i + 4].startswith("| "), lines[i:i + 5]
