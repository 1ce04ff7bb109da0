"""The decode benchmark's code paths on tiny models (numbers are not checked, only that they are produced)."""

import json
import os

import pytest
import torch

from specjax.bench import decode as bench


def _tiny_llama_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def test_model_mode_table(tmp_path, capsys):
    out = tmp_path / "res.json"
    folder = _tiny_llama_folder(tmp_path / "m")
    assert bench.main(["--model", folder, "--batch-sizes", "2", "--new-tokens", "3", "--prompt-len", "5",
                       "--repeats", "1", "--copy-mib", "4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| batch | specjax gen tok/s" in table and "HF decode tok/s" in table
    assert "specjax of limit" in table and "weight-read limit" in table
    res = json.loads(out.read_text())
    assert res["read_bandwidth_Bps"] > 0 and res["weight_bytes_per_step"] > 0
    assert res["read_bandwidth_Bps"] == max(res["product_read_Bps"], res["stream_read_Bps"])
    assert [r["batch"] for r in res["rows"]] == [2]
    for r in res["rows"]:
        assert r["specjax"]["generate_tok_s"] > 0 and r["hf"]["generate_tok_s"] > 0
    res["read_bandwidth_Bps"] = 1.0  # an engine faster than the probes: the table says the limit is understated
    res["rows"][0]["specjax"]["decode_tok_s"] = 50.0  # (3 tokens on a loaded machine may time as nan)
    bench.print_model_table(res)
    assert "the limit is understated" in capsys.readouterr().out


def test_also_dtype_runs_both_dtypes_in_one_run(tmp_path, capsys):
    """--also-dtype: bf16 beside fp32 in the same interleaved run, with the ratio and the greedy agreement."""
    out = tmp_path / "res.json"
    folder = _tiny_llama_folder(tmp_path / "m")
    assert bench.main(["--model", folder, "--batch-sizes", "1", "--new-tokens", "3", "--prompt-len", "5",
                       "--repeats", "1", "--copy-mib", "4", "--no-hf", "--also-dtype", "bfloat16",
                       "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "specjax bfloat16 decode tok/s" in table and "bfloat16 / float32" in table
    row = json.loads(out.read_text())["rows"][0]
    assert row["specjax also"]["generate_tok_s"] > 0  # (decode tok/s of a tiny model's 3 tokens may be noise: nan)
    agree = row["also_agreement"]
    assert agree["rows"] == 1 and agree["rows_identical"] in (0, 1)
    # a row is identical exactly when its common prefix is all 3 tokens
    assert (agree["mean_common_prefix"] == 3) == (agree["rows_identical"] == 1)
    assert 0 <= agree["mean_common_prefix"] <= 3
    with pytest.raises(SystemExit, match="is --dtype already"):
        bench.main(["--model", folder, "--no-hf", "--also-dtype", "float32"])


def test_random_llama_mode(monkeypatch, tmp_path, capsys):
    small = dict(bench.LLAMA_31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(bench, "LLAMA_31_8B", small)
    out = tmp_path / "res.json"
    assert bench.main(["--random-llama-8b", "--layers", "1", "--new-tokens", "3", "--prompt-len", "4",
                       "--repeats", "1", "--copy-mib", "4", "--json", str(out),
                       "--profile-dir", str(tmp_path / "trace")]) == 0
    printed = capsys.readouterr()
    assert "fraction of published" in printed.out and "fraction of the copy" in printed.out
    # XLA:CPU runs on host threads: nothing to summarise (a trace with no device process, or, with the suite's fake
    # CPU devices, device processes without events)
    assert "profile: no device" in printed.err and "on a CPU, XLA's work runs on host threads" in printed.err
    res = json.loads(out.read_text())
    # decode tok/s (hence the fraction) is a difference of two timings: NaN when a loaded CPU inverts them
    assert res["layers"] == 1 and res["copy_bandwidth_Bps"] > 0 and res["specjax"]["generate_tok_s"] > 0
    assert isinstance(res["bandwidth_fraction"], float)
    assert res["device_kind"] == "cpu" and res["published_bandwidth_Bps"] is None  # no datasheet figure for a CPU
    assert res["trace"] is None
    with pytest.raises(SystemExit, match="--profile-dir goes with --random-llama-8b"):
        bench.main(["--profile-dir", str(tmp_path / "trace"), "--no-hf"])
    # every weight but the embedding table: lm_head + one layer + final norm, bf16
    d, f, v = 64, 128, 512
    assert res["weight_bytes_per_token"] == 2 * (d * v + 2 * d + d * 4 * 16 + 2 * d * 2 * 16 + 4 * 16 * d
                                                 + 3 * d * f + d)


def test_random_llama_refuses_what_cannot_run(monkeypatch):
    """--layers below 1, and a model that cannot fit the device, are clear exits before anything is allocated (the
    full 8B shape on a 24 GB CPU was an out-of-memory traceback; --layers 0 silently built all 32 layers)."""
    from specjax.bench import common
    for layers in ("0", "-1"):
        with pytest.raises(SystemExit, match="--layers must be >= 1"):
            bench.main(["--random-llama-8b", "--layers", layers])
    monkeypatch.setattr(common, "available_device_bytes", lambda: 10**9)
    with pytest.raises(SystemExit, match=r"needs 46\.\d GB and the device has 1\.0 GB available; --layers N"):
        bench.main(["--random-llama-8b"])
    monkeypatch.undo()
    assert common.available_device_bytes() > 10**8  # this CPU's MemAvailable


def test_a_decode_window_within_the_repeats_spread_is_flagged(capsys):
    """Decode tok/s is (N - 1) / (t(N) - t(1)) from the fastest repeats; a long prompt with few new tokens leaves a
    window that the run-to-run spread can swamp (a 1024-token prompt with 16 new tokens read 165% of the weight-read
    limit): the rate is still given, with a warning saying how far off it may be."""
    r = bench._rates(1, 16, [5.00, 5.30], [4.80, 4.95])
    assert r["decode_tok_s"] == pytest.approx(15 / 0.20) and r["first_token_s"] == 4.80
    err = capsys.readouterr().err
    assert "decode window t(16) - t(1) = 0.200s" in err and "off by 225%" in err and "--new-tokens" in err, err
    r = bench._rates(1, 64, [6.60, 6.62], [4.80, 4.81])
    assert r["decode_tok_s"] == pytest.approx(63 / 1.80) and capsys.readouterr().err == ""
    bench._rates(1, 64, [6.60], [4.80])  # one repeat: no spread to judge by
    assert capsys.readouterr().err == ""


def test_published_peaks_by_device_kind():
    """The datasheet tables match jax's device_kind strings, the longest name first (an H100 PCIe is no SXM part)."""
    from specjax.train.train_step import peak_hbm_gbps, peak_tflops
    assert peak_hbm_gbps("NVIDIA H200") == (4800.0, "H200")
    assert peak_hbm_gbps("NVIDIA H100 80GB HBM3") == (3350.0, "H100")
    assert peak_hbm_gbps("NVIDIA H100 PCIe") == (2000.0, "H100 PCIe")
    assert peak_hbm_gbps("TPU v5 lite") == (819.0, "TPU v5 lite")
    assert peak_tflops("NVIDIA H100 PCIe") == (756.0, "H100 PCIe")  # was the SXM part's 989: MFU 24% low
    assert peak_tflops("NVIDIA H100 NVL") == (835.0, "H100 NVL") and peak_hbm_gbps("NVIDIA H100 NVL")[0] == 3900.0
    assert peak_hbm_gbps("NVIDIA A100-SXM4-40GB") == (1555.0, "A100-SXM4-40GB")
    assert peak_hbm_gbps("NVIDIA A100-SXM4-80GB") == (2039.0, "A100")
    assert peak_tflops("TPU v4") == (275.0, "TPU v4")
    assert peak_hbm_gbps("cpu") is None and peak_tflops("cpu") is None


def test_llamacpp_runner_decodes_specjax_greedy_tokens():
    """`bench decode --vs llama.cpp`: llama.cpp's batched greedy decode on the F32 GGUF dequantised from SmolLM2's
    published Q4_1 file gives the tokens specjax gives on its converted folder (the same weights)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install llama-cpp-python)")
    from specjax.hub import default_smollm2_path, fetch_smollm2_gguf
    from specjax.models import target
    from specjax.weights import load_model
    if not os.path.isfile(os.path.join(default_smollm2_path(), "config.json")):
        pytest.skip("SmolLM2 not fetched (python -m specjax.convert fetch-smollm2)")
    cfg, params = load_model(default_smollm2_path(), dtype="float32")
    prompts = bench.make_prompts(cfg.vocab_size, 3, 12, seed=3)
    runner = bench.LlamaCppRunner(fetch_smollm2_gguf("float32"), prompts, threads=2, max_new_tokens=12)
    theirs = runner(12)
    runner.close()
    ours = bench.specjax_runner(target.unstack_layers(params), cfg, prompts)(12)
    assert bench._agreement(ours, theirs) == {"rows_identical": 3, "rows": 3, "mean_common_prefix": 12.0}


def test_gemm_bench_chains_the_models_matrices_in_both_layouts(tmp_path, capsys):
    """``bench gemm`` over a tiny model's shapes: one row per M, both layouts timed, the byte count is the model's
    matrices (7 per layer) plus its [vocab, hidden] lm_head; bad --rows is a clear error."""
    from specjax.bench import gemm
    folder = _tiny_llama_folder(tmp_path / "m")
    out = tmp_path / "gemm.json"
    assert gemm.main(["--model", folder, "--rows", "1", "3", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| rows M | in_out ms" in printed and "no 'packed' columns" in printed  # kv width 16: not whole panels
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["results"]] == [1, 3]
    assert all(r["in_out_s"] > 0 and r["out_in_s"] > 0 for r in res["results"])
    d, f, kv, v = 32, 64, 2 * 8, 300  # 4 heads of 8, 2 kv heads
    assert res["weight_bytes"] == 4 * 2 * (2 * d * d + 2 * d * kv + 3 * d * f) + 4 * v * d
    with pytest.raises(ValueError, match="--rows must be >= 1, got 0"):
        gemm.main(["--rows", "0"])


def test_gemm_bench_times_the_cpu_kernels_packed_layout(tmp_path, capsys, cpu_kernels):
    """Shapes of whole 32-column panels: ``bench gemm`` also chains specjax's CPU kernels over packed panels (the
    layout a CPU decode step reads), checked against XLA's products, one more group of columns."""
    from specjax.bench import gemm
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=128, rms_norm_eps=1e-5, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "gemm.json"
    assert gemm.main(["--model", str(tmp_path), "--rows", "1", "4", "--repeats", "1", "--json", str(out)]) == 0
    assert "packed ms" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["layouts"] == ["in_out", "out_in", "packed"]
    assert all(r["packed_s"] > 0 for r in res["results"])


@pytest.mark.parametrize("kind", ["decode", "gemm"])
@pytest.mark.parametrize("threads", ["0", "-2"])
def test_threads_below_one_are_refused_up_front(kind, threads, capsys, monkeypatch):
    """``--threads 0`` was torch's RuntimeError from set_num_threads: one line, exit 2, the environment untouched."""
    from specjax.bench.__main__ import main as bench_main
    monkeypatch.delenv("SPECJAX_CPU_THREADS", raising=False)
    assert bench_main([kind, "--threads", threads]) == 2
    assert capsys.readouterr().err.strip() == f"python -m specjax.bench {kind}: error: --threads must be >= 1, got " \
                                              f"{threads}"
    assert "SPECJAX_CPU_THREADS" not in os.environ


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "0"], "--batch-sizes must be >= 1, got 0"),
    (["--batch-sizes", "1", "-1"], "--batch-sizes must be >= 1, got -1"),
    (["--copy-mib", "0"], "--copy-mib must be >= 1, got 0"),
    (["--copy-mib", "-5"], "--copy-mib must be >= 1, got -5"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1, got 0"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2 (decode tok/s is measured against a 1-token run), got 1"),
    (["--random-llama-8b", "--repeats", "0"], "--repeats must be >= 1, got 0"),
])
def test_count_flags_are_checked_up_front(flags, message, capsys, monkeypatch):
    """Bad counts are one line naming the flag, exit 2, before any model is loaded or measured: --batch-sizes 0 was a
    ZeroDivisionError after the whole run, --repeats 0 an empty min() after it, --copy-mib -5 a JAX traceback and
    --copy-mib 0 silently 256."""
    from specjax.bench.__main__ import main as bench_main
    monkeypatch.setattr(bench, "bench_model", lambda args: pytest.fail("measured despite a bad flag"))
    monkeypatch.setattr(bench, "bench_random_llama", lambda args: pytest.fail("measured despite a bad flag"))
    assert bench_main(["decode", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"python -m specjax.bench decode: error: {message}"


def test_prompt_past_the_context_is_refused_before_measuring(tmp_path, monkeypatch):
    """--prompt-len + --new-tokens past max_position_embeddings (128) is refused before the bandwidth probes and the
    runs (--prompt-len 100000 ground on until killed)."""
    folder = _tiny_llama_folder(tmp_path / "m")
    monkeypatch.setattr(bench, "read_bandwidth", lambda *a: pytest.fail("measured despite a prompt too long"))
    with pytest.raises(ValueError, match=r"^127 prompt tokens \+ 2 new tokens = 129 is longer than the model's "
                                         r"max_position_embeddings \(128\).*; lower --prompt-len or --new-tokens$"):
        bench.main(["--model", folder, "--no-hf", "--batch-sizes", "1", "--prompt-len", "127", "--new-tokens", "2"])


@pytest.mark.parametrize("flags, message", [(["--repeats", "0"], "--repeats must be >= 1, got 0"),
                                            (["--rows", "1", "0"], "--rows must be >= 1, got 0")])
def test_gemm_count_flags_are_checked_up_front(flags, message, capsys, monkeypatch):
    """``bench gemm`` checks its counts with ``bench decode``'s check: one line naming the flag, exit 2."""
    from specjax.bench import gemm
    from specjax.bench.__main__ import main as bench_main
    monkeypatch.setattr(gemm, "bench_gemm", lambda args: pytest.fail("measured despite a bad flag"))
    assert bench_main(["gemm", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"python -m specjax.bench gemm: error: {message}"
