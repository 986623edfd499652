"""Models: preset / config.json / pretrained-dir resolution, config_for, overrides, seeded builds."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from dsframework.config import DataSpec, ModelSpec, build_run_config  # noqa: E402
from dsframework.data import train_tokenizer  # noqa: E402
from dsframework.errors import UserError  # noqa: E402
from dsframework.models.build import build_model, init_weights_deterministically, resolve_model  # noqa: E402
from dsframework.models.hf import causal_lm_class, count_parameters  # noqa: E402
from dsframework.models.presets import PRESETS  # noqa: E402

BUILT = ["tiny-llama", "tiny-gpt2"]  # small-llama is built once, in the init test


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer of 16 tokens (10 digits, '+', '=', 4 specials)."""
    spec = DataSpec(dataset="addition", num_examples=200)
    texts = datasets.Dataset.from_dict({"text": [f"{i}+{i}={2 * i}" for i in range(100)]})
    return train_tokenizer(texts, spec)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    texts = datasets.Dataset.from_dict({"text": [f"a longer document number {i}, with words" for i in range(100)]})
    return train_tokenizer(texts, DataSpec(dataset="/data/user.jsonl", tokenizer_vocab_size=300))


def _preset_field(config, key):
    if hasattr(config, key):
        return getattr(config, key)
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5 keeps rope_theta there
    return rope[key] if key in rope else rope["full_attention"][key]  # (per layer type: Gemma 3)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _built(name, tokenizer, *, seed, overrides=None):
    source = resolve_model(ModelSpec(name=name, overrides=overrides or {}))
    return build_model(source, source.config_for(tokenizer), seed=seed)


# --- resolution ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_its_config(name):
    source = resolve_model(ModelSpec(name=name))
    fields = PRESETS[name]
    assert source.config.model_type == fields["model_type"]
    assert type(source.config) is transformers.CONFIG_MAPPING[fields["model_type"]]
    for key, value in fields.items():
        assert _preset_field(source.config, key) == value, key
    assert source.pretrained_dir is None and source.tokenizer_dir is None
    cls = causal_lm_class(source.config)
    assert issubclass(cls, transformers.PreTrainedModel) and cls.config_class is type(source.config)
    assert cls.__name__ in {"LlamaForCausalLM", "GPT2LMHeadModel", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                            "Phi3ForCausalLM", "Olmo2ForCausalLM", "Qwen3MoeForCausalLM"}


def test_unknown_name_suggests_a_preset():
    with pytest.raises(UserError) as info:
        resolve_model(ModelSpec(name="tiny-lama"))
    assert "model.name='tiny-lama'" in str(info.value)
    assert "did you mean 'tiny-llama'?" in str(info.value)


@pytest.mark.parametrize("name", BUILT)
def test_config_json_path_resolves_to_random_init(tmp_path, name, tokenizer):
    fields = {**PRESETS[name], "vocab_size": 100}
    (tmp_path / "my-config.json").write_text(json.dumps(fields))
    source = resolve_model(ModelSpec(name=str(tmp_path / "my-config.json")))
    assert source.pretrained_dir is None and source.tokenizer_dir is None
    assert source.config.model_type == fields["model_type"]
    for key, value in fields.items():
        assert _preset_field(source.config, key) == value, key
    # Random init: the vocabulary follows the tokenizer.
    assert source.config_for(tokenizer).vocab_size == len(tokenizer)


def test_directory_with_config_but_no_weights_is_random_init(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    source = resolve_model(ModelSpec(name=str(tmp_path)))
    assert source.pretrained_dir is None
    assert source.config.hidden_size == PRESETS["tiny-llama"]["hidden_size"]


@pytest.mark.parametrize("content, fragment", [
    ({"hidden_size": 8}, "config has no model_type"),
    ({"model_type": "lama"}, "did you mean 'llama'?"),
    ({"model_type": "t5"}, "architecture 't5' has no causal LM head"),
    ([1, 2], "is not a JSON object"),
    ("{broken", "is not readable JSON"),
])
def test_bad_config_json_is_a_user_error(tmp_path, content, fragment):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError) as info:
        resolve_model(ModelSpec(name=str(path)))
    assert fragment in str(info.value)


def test_directory_without_config_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(ModelSpec(name=str(tmp_path)))


@pytest.mark.parametrize("name", BUILT)
def test_pretrained_directory_loads_exactly_its_weights(tmp_path, name, tokenizer):
    original = _built(name, tokenizer, seed=3)
    original.save_pretrained(str(tmp_path / "pretrained"))
    source = resolve_model(ModelSpec(name=str(tmp_path / "pretrained")))
    assert source.pretrained_dir == tmp_path / "pretrained"
    assert source.tokenizer_dir is None  # no tokenizer saved there (yet)
    config = source.config_for(tokenizer)
    loaded = build_model(source, config, seed=99)  # the seed must not touch pretrained weights
    expected, got = _state(original), _state(loaded)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    # ... whereas a random init with that seed would differ.
    fresh = _state(_built(name, tokenizer, seed=99))
    assert any(not torch.equal(fresh[k], expected[k]) for k in expected)


def test_pretrained_directory_with_tokenizer_has_tokenizer_dir(tmp_path, tokenizer):
    _built("tiny-llama", tokenizer, seed=0).save_pretrained(str(tmp_path))
    assert resolve_model(ModelSpec(name=str(tmp_path))).tokenizer_dir is None
    tokenizer.save_pretrained(str(tmp_path))
    assert resolve_model(ModelSpec(name=str(tmp_path))).tokenizer_dir == tmp_path


def test_pretrained_vocab_must_cover_the_tokenizer(tmp_path, tokenizer, bpe_tokenizer):
    _built("tiny-llama", tokenizer, seed=0).save_pretrained(str(tmp_path))  # vocab_size 16
    source = resolve_model(ModelSpec(name=str(tmp_path)))
    assert source.config_for(tokenizer).vocab_size == len(tokenizer)
    with pytest.raises(UserError, match="more than the model's vocab_size=16"):
        resolve_model(ModelSpec(name=str(tmp_path))).config_for(bpe_tokenizer)


# --- config_for and overrides ---------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILT + ["llama-7b"])
def test_config_for_random_init_follows_the_tokenizer(name, tokenizer):
    source = resolve_model(ModelSpec(name=name))
    assert source.config.vocab_size != len(tokenizer)
    config = source.config_for(tokenizer)
    assert config.vocab_size == len(tokenizer)
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert len({config.bos_token_id, config.eos_token_id, config.pad_token_id}) == 3


def test_vocab_size_override_larger_is_kept_smaller_is_an_error(tokenizer):
    source = resolve_model(ModelSpec(name="tiny-llama", overrides={"vocab_size": 64}))
    assert source.config_for(tokenizer).vocab_size == 64
    source = resolve_model(ModelSpec(name="tiny-llama", overrides={"vocab_size": 8}))
    with pytest.raises(UserError, match="model.overrides.vocab_size=8"):
        source.config_for(tokenizer)


def test_overrides_are_applied_to_config_and_model(tokenizer):
    run = build_run_config({"model": {"name": "tiny-llama"}},
                           ["model.overrides.num_hidden_layers=3", "model.overrides.intermediate_size=40"])
    source = resolve_model(run.model)
    assert source.config.num_hidden_layers == 3 and source.config.intermediate_size == 40
    model = build_model(source, source.config_for(tokenizer), seed=0)
    assert len(model.model.layers) == 3
    assert model.model.layers[0].mlp.up_proj.weight.shape == (40, PRESETS["tiny-llama"]["hidden_size"])


def test_gpt2_override_by_attribute_alias():
    source = resolve_model(ModelSpec(name="tiny-gpt2", overrides={"hidden_size": 32, "n_layer": 1}))
    assert source.config.n_embd == 32 and source.config.n_layer == 1


def test_hidden_size_override_updates_head_dim():
    source = resolve_model(ModelSpec(name="tiny-llama", overrides={"hidden_size": 32}))
    assert source.config.head_dim == 32 // source.config.num_attention_heads


def test_rope_theta_override_is_accepted():
    source = resolve_model(ModelSpec(name="tiny-llama", overrides={"rope_theta": 500000.0}))
    assert _preset_field(source.config, "rope_theta") == 500000.0


def test_unknown_override_suggests_the_field():
    with pytest.raises(UserError) as info:
        resolve_model(ModelSpec(name="tiny-llama", overrides={"num_hiden_layers": 3}))
    message = str(info.value)
    assert message.startswith("model.overrides.num_hiden_layers=3")
    assert "did you mean 'num_hidden_layers'?" in message


def test_wrongly_typed_override_is_a_user_error():
    with pytest.raises(UserError, match="model.overrides.num_hidden_layers"):
        resolve_model(ModelSpec(name="tiny-llama", overrides={"num_hidden_layers": "four"}))


# --- deterministic construction -----------------------------------------------------------------

@pytest.mark.parametrize("name", BUILT)
def test_build_is_deterministic_per_seed(name, tokenizer):
    first, second = _state(_built(name, tokenizer, seed=7)), _state(_built(name, tokenizer, seed=7))
    other = _state(_built(name, tokenizer, seed=8))
    assert first.keys() == second.keys() == other.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    matrices = [k for k, v in first.items() if v.dim() == 2]
    assert len(matrices) >= 5
    for key in matrices:  # every randomly initialised weight changes with the seed
        assert not torch.equal(first[key], other[key]), key


@pytest.mark.parametrize("name", BUILT + ["small-llama"])
def test_init_weights_deterministically_ignores_the_global_rng(name, tokenizer):
    source = resolve_model(ModelSpec(name=name))
    config = source.config_for(tokenizer)
    cls = causal_lm_class(config)
    torch.manual_seed(0)
    a = cls._from_config(config, dtype=torch.float32)
    torch.manual_seed(1)
    torch.rand(17)  # a different global RNG state, not just a different seed
    b = cls._from_config(config, dtype=torch.float32)
    before_a, before_b = _state(a), _state(b)
    assert any(not torch.equal(before_a[k], before_b[k]) for k in before_a)  # the RNG did matter
    init_weights_deterministically(a, 5)
    torch.manual_seed(123)
    init_weights_deterministically(b, 5)
    after_a, after_b = _state(a), _state(b)
    for key in after_a:
        assert torch.equal(after_a[key], after_b[key]), key
    # It is what build_model does for a random init, whatever the RNG state before the call.
    torch.manual_seed(999)
    built = _state(build_model(source, config, seed=5))
    for key in after_a:
        assert torch.equal(after_a[key], built[key]), key


@pytest.mark.parametrize("name", BUILT)
def test_count_parameters(name, tokenizer):
    model = _built(name, tokenizer, seed=0)
    total = sum(p.numel() for p in model.parameters())
    assert count_parameters(model) == total
    if name == "tiny-llama":  # by hand: V=16, H=64, kv width 2*16=32, I=176, 2 layers, untied head
        per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64
        assert total == 2 * 16 * 64 + 2 * per_layer + 64
    else:  # tied embeddings are counted once
        assert model.lm_head.weight is model.transformer.wte.weight
        assert total == sum(p.numel() for k, p in model.named_parameters(remove_duplicate=True))
        assert total < sum(v.numel() for v in model.state_dict().values())


def test_count_parameters_uses_the_full_size_of_partitioned_params(tokenizer):
    model = _built("tiny-llama", tokenizer, seed=0)
    total = count_parameters(model)
    param = model.model.embed_tokens.weight
    param.ds_numel = param.numel() + 1000  # as ZeRO-3 marks a parameter whose local shard is smaller
    assert count_parameters(model) == total + 1000
