"""What the TPU preflight tests share (tests/test_preflight*.py): the abstract topologies, small Llama-shaped
configs, the printed table's rows."""

import json
import re

import pytest

preflight = pytest.importorskip("specjax.preflight")

GIB = 2 ** 30


def topology(name: str):
    """The abstract TPU topology ``name`` (libtpu); skips the test with the reason when libtpu is missing."""
    try:
        return preflight.get_topology(name)
    except preflight.PreflightError as e:
        pytest.skip(str(e))


def small_config(tmp_path, *, heads=4, kv_heads=2, dtype="float32", layers=2, head_dim=64, context=256):
    """A Llama shaped like a small slice of a real one (head dim 64), so each program compiles in seconds. Two layers:
    the programs read the stacked KV pool at a layer other than the first (each more layer adds a few seconds of TPU
    compile to every program)."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=heads * head_dim,
               intermediate_size=256, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=context, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, torch_dtype=dtype, bos_token_id=1, eos_token_id=2)
    path = tmp_path / f"config-{heads}-{kv_heads}-{dtype}-{head_dim}-{context}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# The server's flags, small: 4 slots, a 4096-token pool, one prefill bucket (16), a 3-step tree.
PLAIN_SMALL_FLAGS = ["--max-running-requests", "4", "--max-total-tokens", "4096", "--chunked-prefill-size", "16"]
# with a (2,2,4) tree (the server refuses tree flags without a speculative algorithm: plain programs take the above)
SMALL_FLAGS = PLAIN_SMALL_FLAGS + ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
                                   "--speculative-num-draft-tokens", "4"]


def rows(out: str) -> dict:
    """{program: (args GiB, temp GiB, total GiB, fits)} from the printed tables."""
    pat = re.compile(r"^(\S.*?)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+\s+(yes|NO)\s", re.M)
    return {m[0].strip(): (float(m[1]), float(m[2]), float(m[3]), m[4] == "yes") for m in pat.findall(out)}
