"""The decode benchmark's code paths on tiny models (numbers are not checked, only that they are produced)."""

import json

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
    assert [r["batch"] for r in res["rows"]] == [2]
    for r in res["rows"]:
        assert r["specjax"]["generate_tok_s"] > 0 and r["hf"]["generate_tok_s"] > 0


def test_random_llama_mode(monkeypatch, tmp_path, capsys):
    small = dict(bench.LLAMA_31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(bench, "LLAMA_31_8B", small)
    out = tmp_path / "res.json"
    assert bench.main(["--random-llama-8b", "--layers", "1", "--new-tokens", "3", "--prompt-len", "4",
                       "--repeats", "1", "--copy-mib", "4", "--json", str(out)]) == 0
    assert "fraction of limit" in capsys.readouterr().out
    res = json.loads(out.read_text())
    # decode tok/s (hence the fraction) is a difference of two timings: NaN when a loaded CPU inverts them
    assert res["layers"] == 1 and res["copy_bandwidth_Bps"] > 0 and res["specjax"]["generate_tok_s"] > 0
    assert isinstance(res["bandwidth_fraction"], float)
    # every weight but the embedding table: lm_head + one layer + final norm, bf16
    d, f, v = 64, 128, 512
    assert res["weight_bytes_per_token"] == 2 * (d * v + 2 * d + d * 4 * 16 + 2 * d * 2 * 16 + 4 * 16 * d + 3 * d * f + d)
