"""Plain generation: sampling sanity, per-row stopping, token budgets, generate_text and the CLI.

Every ``generate`` call here has the same bucketed shapes (4 prompts of <= 16 tokens, budget <= 16, page size 16),
so the whole file compiles the prefill and the decode loop once (the speculative comparison, one prompt with an
EAGLE3 head, compiles its own).
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from spec_models import random_models
from specjax.config import ModelConfig
from specjax.generate import GenerateOptions, _parser, _resolve_pair, encode_prompts, generate, generate_text, main
from specjax.head_weights import params_to_hf as head_to_hf
from specjax.heads import DEFAULT_HEAD
from specjax.models import eagle, target
from specjax.safetensors_io import save_file
from specjax.speculative import tune as tune_lib
from specjax.weights import params_to_hf

VOCAB = 128
HF_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 bos_token_id=1, eos_token_id=2, torch_dtype="float32", rope_theta=10000.0)
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13], [1, 20], [1, 30, 31, 32, 33]]
KW = dict(max_new_tokens=12)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_hf_dict(HF_CONFIG)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jax.device_put((rng.standard_normal(s.shape) * 0.3).astype(np.float32)),
                          target.param_shapes(cfg))  # device arrays, like load_model's: one jit cache entry
    return cfg, params


def test_greedy_is_deterministic_and_full_length_without_stop(model):
    cfg, params = model
    a = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    assert a == generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    assert [len(o) for o in a] == [12] * 4
    assert all(0 <= t < VOCAB for o in a for t in o)


def test_top_k_1_equals_greedy(model):
    cfg, params = model
    greedy = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    assert generate(params, cfg, PROMPTS, temperature=1.5, top_k=1, seed=[3, 4, 5, 6], stop_token_ids=(),
                    **KW) == greedy


def test_seeded_sampling(model):
    cfg, params = model
    kw = dict(temperature=1.0, stop_token_ids=(), **KW)
    a = generate(params, cfg, PROMPTS, seed=[10, 11, 12, 13], **kw)
    assert a == generate(params, cfg, PROMPTS, seed=[10, 11, 12, 13], **kw)  # reproducible
    # Each row has its own stream: permuting the batch (with its seeds) permutes the outputs.
    perm = [2, 0, 3, 1]
    b = generate(params, cfg, [PROMPTS[i] for i in perm], seed=[[10, 11, 12, 13][i] for i in perm], **kw)
    assert b == [a[i] for i in perm]
    # Other seeds give other samples.
    c = generate(params, cfg, PROMPTS, seed=[20, 21, 22, 23], **kw)
    assert all(x != y for x, y in zip(a, c))
    # Same prompt, same seed in every row -> identical rows; one seed per call is broadcast.
    same = generate(params, cfg, [PROMPTS[0]] * 4, seed=7, **kw)
    assert all(o == same[0] for o in same)
    greedy = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    assert a != greedy


def test_sampling_respects_top_k(model):
    """At a high temperature with top_k=2, every sampled token is one of the model's two most likely tokens."""
    cfg, params = model
    out = generate(params, cfg, PROMPTS, temperature=5.0, top_k=2, seed=[1, 2, 3, 4], stop_token_ids=(), **KW)
    seqs = np.zeros((4, 20), np.int32)  # right-padded prompt + output; causal, so padding does not matter
    for i, (p, o) in enumerate(zip(PROMPTS, out)):
        seqs[i, :len(p) + len(o)] = p + o
    positions = np.broadcast_to(np.arange(20, dtype=np.int32), seqs.shape)
    logits = np.asarray(jax.jit(target.forward, static_argnums=1)(params, cfg, seqs, positions).logits)
    top2 = np.argsort(-logits, axis=-1)[..., :2]  # [4, 20, 2]
    for i, (p, o) in enumerate(zip(PROMPTS, out)):
        for j, tok in enumerate(o):
            assert tok in top2[i, len(p) - 1 + j]
    assert out != generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)  # not simply greedy


def test_rows_stop_on_their_own_stop_token(model):
    cfg, params = model
    free = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    stop = {free[0][2], free[3][6]}
    want = []
    for o in free:
        hits = [j for j, t in enumerate(o) if t in stop]
        want.append(o[:hits[0] + 1] if hits else o)
    got = generate(params, cfg, PROMPTS, stop_token_ids=sorted(stop), **KW)
    assert got == want  # stop token included, like HF generate
    assert len(got[0]) <= 3 and got[0][-1] in stop
    assert len({len(g) for g in got}) > 1  # rows ended at different steps; the others kept going


def test_default_stop_is_config_eos(model):
    cfg, params = model
    free = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    eos = free[1][4]
    # (A config with another eos would be another compile; test_parity covers the default against HF.)
    default = generate(params, cfg, PROMPTS, **KW)
    assert default == generate(params, cfg, PROMPTS, stop_token_ids=cfg.eos_token_ids, **KW)
    assert generate(params, cfg, PROMPTS, stop_token_ids=[eos], **KW)[1] == free[1][:free[1].index(eos) + 1]


def test_max_new_tokens(model):
    cfg, params = model
    free = generate(params, cfg, PROMPTS, stop_token_ids=(), **KW)
    got = generate(params, cfg, PROMPTS, stop_token_ids=(), max_new_tokens=[5, 1, 0, 12])
    assert got == [free[0][:5], free[1][:1], [], free[3]]
    assert generate(params, cfg, PROMPTS, max_new_tokens=0) == [[], [], [], []]
    assert generate(params, cfg, [], max_new_tokens=4) == []


@pytest.mark.parametrize("kw,match", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                      (dict(top_k=0), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens")])
def test_bad_arguments(model, kw, match):
    cfg, params = model
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, PROMPTS, **{**KW, **kw})


def test_bad_prompts(model):
    cfg, params = model
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(params, cfg, [[1], []], **KW)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 128\): \[128\]"):
        generate(params, cfg, [[1, 128]], **KW)


# ---- text in, text out ------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    """The tiny model as an HF folder (config.json, model.safetensors) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    cfg, params = model
    folder = tmp_path_factory.mktemp("tiny_text")
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    save_file(params_to_hf(params, cfg), str(folder / "model.safetensors"))
    words = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(5, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return str(folder)


def test_generate_text(model, model_dir):
    from specjax.generate import load_tokenizer
    cfg, params = model
    tok = load_tokenizer(model_dir)
    prompts = ["w5 w6", "w7 w8 w9", "w10", "w11 w12"]  # a batch of 4, like every other call in this file
    chat_ids = encode_prompts(tok, prompts, chat=True)
    assert chat_ids[0] == [3, 5, 6, 4]  # <|user|> w5 w6 <|assistant|>
    texts = generate_text(model_dir, prompts, chat=True, max_new_tokens=6, tokenizer=tok)  # test_cli loads it
    ids = generate(params, cfg, chat_ids, max_new_tokens=6, stop_token_ids=(2,))
    assert texts == [tok.decode(o, skip_special_tokens=True) for o in ids]
    assert all(w.startswith("w") for t in texts for w in t.split())
    assert encode_prompts(tok, ["w5"], chat=False)[0][-1] == 5


def test_cli(model_dir, capsys):
    prompts = [a for p in ("w5 w6", "w7", "w8", "w9") for a in ("--prompt", p)]
    assert main(["--model", model_dir, *prompts, "--chat", "--max-new-tokens", "4", "--temperature", "0.7",
                 "--top-k", "5", "--top-p", "0.9", "--seed", "3", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "--- [0] w5 w6" in out and "--- [3] w9" in out


def test_cli_speculative_comparison(model, model_dir, tmp_path, capsys):
    """The README's first command on a tiny pair: with an EAGLE3 head, the CLI prints the answer, the EAGLE3 run's
    tok/s and accept length, then the plain run's and that the greedy outputs are identical."""
    from specjax.convert.head import export_head
    cfg, _ = model
    _, (hcfg, hparams, vmap), _ = random_models(cfg, seed=3)
    head = str(tmp_path / "head")
    export_head(hparams, hcfg, vmap, head, cfg)
    args = ["--model", model_dir, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
            "--prompt", "w5 w6", "--chat"]
    assert main(args + ["--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"EAGLE3: \d+ tokens in [\d.]+ s = [\d.]+ tok/s, accept length [\d.]+ tokens per verify step", out)
    assert re.search(r"plain: \d+ tokens in [\d.]+ s = [\d.]+ tok/s; speedup [\d.]+x; output identical to plain "
                     r"decoding \(medians of 3 runs each, taking turns\)", out)
    assert main(args + ["--max-new-tokens", "4", "--timing-runs", "0"]) == 2
    assert "--timing-runs must be >= 1" in capsys.readouterr().err


def test_cli_eagle_head_with_token_map(model, model_dir, tmp_path, capsys):
    """An EAGLE head with an FR-Spec token map from the CLI (the server's and Engine's flag): greedy output identical
    to plain; the map with an EAGLE3 head is refused rather than ignored."""
    cfg, _ = model
    _, _, (ecfg, eparams, _) = random_models(cfg, seed=4)
    head = tmp_path / "eagle"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(eagle.config_to_hf(ecfg)))
    save_file(head_to_hf(eparams, ecfg), str(head / "model.safetensors"))
    (tmp_path / "hot.json").write_text(json.dumps([int(i) for i in np.arange(0, VOCAB, 2)]))
    args = ["--model", model_dir, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head),
            "--speculative-token-map", str(tmp_path / "hot.json"), "--speculative-num-steps", "2",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3", "--prompt", "w5 w6",
            "--max-new-tokens", "12", "--timing-runs", "1"]
    assert main(args) == 0
    assert "output identical to plain decoding" in capsys.readouterr().out
    args[3] = "NONE"  # plain decoding has no draft to cut: refused, as the tree flags are
    assert main(args) == 2
    assert "--speculative-token-map is for EAGLE heads" in capsys.readouterr().err


def test_cli_errors(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert main(["--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Pass a local folder" in err and "Traceback" not in err
    assert main(["--model", str(tmp_path)]) == 2  # a folder without config.json
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main(["--model", str(tmp_path)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    # a head with NONE would be silently ignored; NaN sampling parameters would give a silent empty answer
    assert main(["--model", str(tmp_path), "--speculative-algorithm", "NONE", "--speculative-draft-model-path",
                 str(tmp_path)]) == 2
    assert "--speculative-algorithm NONE decodes plainly" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--temperature", "nan"]) == 2
    assert "temperature must be a finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--prompt", "--chat", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                 "--seed", "--dtype"):
        assert flag in help_text


def test_tree_flags_fill_from_the_tuned_shape(tmp_path):
    """One tree flag: the others from the head's tuned shape (here a table tuned to (1, 2, 3) at batch 1), a chain's
    num_draft_tokens = num_steps + 1 (was (5, 1, 6)'s values, then an error naming num_draft_tokens=6, never set)."""
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    table = json.loads(open(os.path.join(DEFAULT_HEAD, tune_lib.FILENAME)).read())
    table["batch_sizes"]["1"] = dict(zip(tune_lib.SHAPE_KEYS, (1, 2, 3)))
    tune_lib.save_tune(str(tuned / tune_lib.FILENAME), table)

    def shape(head=str(tuned), **flags):
        opts = GenerateOptions(model=str(tmp_path), speculative_algorithm="EAGLE3",
                               speculative_draft_model_path=head, **flags)
        return _resolve_pair(opts)[3]
    assert shape(DEFAULT_HEAD) == tune_lib.shape_for(tune_lib.load_tune(DEFAULT_HEAD), 1)  # the shipped table's
    assert shape() == (1, 2, 3)
    assert shape(speculative_num_steps=3) == (3, 2, 3)
    assert shape(speculative_eagle_topk=1) == (1, 1, 2)
    assert shape(speculative_eagle_topk=1, speculative_num_draft_tokens=5) == (4, 1, 5)
    assert shape(head=str(tmp_path), speculative_num_steps=3) == (3, 1, 4)  # no tune table: a chain
    assert shape(head=str(tmp_path), speculative_eagle_topk=4, speculative_num_steps=1) == (1, 4, 5)
    with pytest.raises(ValueError, match="num_draft_tokens=9 exceeds"):
        shape(speculative_num_draft_tokens=9)
    help_text = " ".join(_parser().format_help().split())
    assert "num_steps + 1 when eagle_topk is 1" in help_text and "else 5" in help_text


def test_tree_flags_without_a_head_are_refused(tmp_path, capsys):
    """Tree flags with a model and no --speculative-algorithm decode plainly: refused, not silently ignored."""
    assert main(["--model", str(tmp_path), "--speculative-num-steps", "3", "--speculative-eagle-topk", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: tree flags (--speculative-num-steps, --speculative-eagle-topk) need --speculative-algorithm and "
        "--speculative-draft-model-path")
    assert main(["--model", str(tmp_path), "--speculative-algorithm", "NONE", "--speculative-num-draft-tokens",
                 "4"]) == 2
    assert "error: tree flags (--speculative-num-draft-tokens) need" in capsys.readouterr().err


def test_cli_config_json_of_the_wrong_shape(tmp_path, capsys):
    """A config.json that is JSON but not an object was an AttributeError traceback; a wrong field type was a
    TypeError, or an error naming neither the field nor the file."""
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}/config.json must be a JSON object"
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_CONFIG, hidden_size="64")))
    assert main(["--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path}/config.json: hidden_size must be an integer >= 1, "
                                               f"got '64'")


def test_cli_refuses_to_run_past_the_context(model_dir, capsys):
    """A prompt + --max-new-tokens past max_position_embeddings (4096, the default: the tiny config names none) is
    refused before any work, as the server refuses it (was: text from positions never trained, no warning)."""
    assert main(["--model", model_dir, "--prompt", "w5 w6", "--max-new-tokens", "4095"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: 2 prompt tokens + 4095 new tokens = 4097 is longer than the model's max_position_embeddings (4096): "
        "positions past it were never trained and give wrong outputs; shorten the prompt or lower --max-new-tokens")
    assert main(["--model", model_dir, "--prompt", " ".join(["w5"] * 4000), "--max-new-tokens", "100"]) == 2
    assert "error: 4000 prompt tokens + 100 new tokens = 4100 is longer" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (dict(speculative_num_draft_tokens=0), "--speculative-num-draft-tokens must be >= 2 (the root + at least one "
                                           "draft token), got 0"),
    (dict(speculative_num_draft_tokens=1), "--speculative-num-draft-tokens must be >= 2 (the root + at least one "
                                           "draft token), got 1"),
    (dict(speculative_num_steps=0, speculative_num_draft_tokens=4), "--speculative-num-steps must be >= 1, got 0"),
    (dict(speculative_eagle_topk=-1), "--speculative-eagle-topk must be >= 1, got -1"),
])
def test_tree_flags_out_of_range_name_the_flag_given(tmp_path, flags, message):
    """--speculative-num-draft-tokens 0 blamed num_steps (derived from it: -1), a flag the user never passed."""
    opts = GenerateOptions(model=str(tmp_path), speculative_algorithm="EAGLE3",
                           speculative_draft_model_path=str(tmp_path), **flags)
    with pytest.raises(ValueError) as e:
        _resolve_pair(opts)
    assert str(e.value) == message


def test_cli_tree_flag_out_of_range(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                 str(tmp_path), "--prompt", "hi", "--speculative-num-draft-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --speculative-num-draft-tokens must be >= 2 (the root + at "
                                               "least one draft token), got 0")
