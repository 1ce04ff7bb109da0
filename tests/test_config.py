"""``ModelConfig`` from a config.json: a file of the wrong shape or a field of the wrong type is a ``ConfigError``
naming the file and the field (was an AttributeError, a TypeError, or a message blaming something else)."""

import json

import pytest

from specjax.config import ConfigError, ModelConfig

GOOD = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2)


def _write(tmp_path, content) -> str:
    (tmp_path / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("content", ["[1, 2]", "3", '"LlamaForCausalLM"', "null"])
def test_config_json_that_is_not_an_object(tmp_path, content):
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(tmp_path))
    assert str(e.value) == f"{path} must be a JSON object"


@pytest.mark.parametrize("value", ["LlamaForCausalLM", [1], {"LlamaForCausalLM": 1}])
def test_architectures_must_be_a_list_of_names(tmp_path, value):
    path = _write(tmp_path, dict(GOOD, architectures=value))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(tmp_path))
    assert str(e.value) == f'{path}: architectures must be a list of names (e.g. ["LlamaForCausalLM"]), got {value!r}'


@pytest.mark.parametrize("field, value, what", [
    ("hidden_size", "64", "an integer >= 1"),
    ("vocab_size", 128.5, "an integer >= 1"),
    ("num_hidden_layers", True, "an integer >= 1"),  # a bool is not an int
    ("num_attention_heads", 0, "an integer >= 1"),
    ("num_key_value_heads", -2, "an integer >= 1"),
    ("max_position_embeddings", "4096", "an integer >= 1"),
    ("head_dim", "16", "an integer >= 1"),
    ("vocab_size", None, "an integer >= 1"),
    ("rms_norm_eps", "abc", "a number >= 0"),
    ("rms_norm_eps", False, "a number >= 0"),
    ("rope_theta", "1e4", "a number > 0"),
    ("bos_token_id", "1", "an integer or null"),
    ("eos_token_id", [2, "3"], "a token id, a list of token ids or null"),
    ("tie_word_embeddings", "false", "true or false"),
    ("rope_scaling", "linear", "an object or null"),
])
def test_numeric_fields_of_the_wrong_type_name_the_field_and_the_file(tmp_path, field, value, what):
    path = _write(tmp_path, dict(GOOD, **{field: value}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(tmp_path))
    assert str(e.value) == f"{path}: {field} must be {what}, got {value!r}"


def test_rope_scaling_numbers_are_checked(tmp_path):
    scaling = {"rope_type": "llama3", "factor": "8", "original_max_position_embeddings": 8192}
    path = _write(tmp_path, dict(GOOD, rope_scaling=scaling))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(tmp_path))
    assert str(e.value) == f"{path}: rope_scaling.factor must be a number > 0, got '8'"


def test_check_context(tmp_path):
    """A prompt + new tokens past max_position_embeddings is refused (as the server refuses a longer context); the
    nulls and numbers configs use pass the type checks (optional fields null: their defaults; an int for a float)."""
    _write(tmp_path, dict(GOOD, num_key_value_heads=None, head_dim=None, rope_theta=10000, rms_norm_eps=0,
                          eos_token_id=[2, 3], bos_token_id=None, sliding_window=None, tie_word_embeddings=True))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.eos_token_ids) == (4, 16, 10000.0, (2, 3))
    cfg.check_context(500, 12, "lower it")  # exactly the context
    with pytest.raises(ValueError, match=r"^500 prompt tokens \+ 13 new tokens = 513 is longer than the model's "
                                         r"max_position_embeddings \(512\): positions past it were never trained "
                                         r"and give wrong outputs; lower it$"):
        cfg.check_context(500, 13, "lower it")
