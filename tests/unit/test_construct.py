"""Sharded construction (models/construct.py), without processes: a tensor rank's shards of a
pipeline stage, built on meta and materialised one module at a time, equal what the dense build
then `shard_model` gives - from the seeded init and from a pretrained directory read slice by
slice (several safetensors files and an index) - and a broken pretrained directory is named.

Tensor ranks are simulated with LayoutOnlyGroup (the layout of rank r of tp, no process group).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from dsframework.config import ModelSpec
from dsframework.errors import UserError
from dsframework.models.build import build_model, resolve_model
from dsframework.models.construct import (PretrainedSlices, SeededInit, check_pretrained_files, dense_templates,
                                          empty_model, materialize)
from dsframework.models.tensor_parallel import shard_model
from dsframework.models.pipeline import stage_module_paths
from dsframework.parallel.tensor import LayoutOnlyGroup

MODELS = {"llama": ("tiny-llama", {}), "llama-tied": ("tiny-llama", {"tie_word_embeddings": True}),
          "gpt2": ("tiny-gpt2", {})}
PLACES = [(tp, rank, pipeline) for tp in (1, 2) for rank in range(tp) for pipeline in (None, (2, 0), (2, 1))]


def sharded_meta(config, tp: int, rank: int):
    model = empty_model(config)
    templates = dense_templates(model)
    if tp > 1:
        shard_model(model, group=LayoutOnlyGroup(size=tp, rank=rank))
    return model, templates


def owned_paths(model, pipeline):
    return None if pipeline is None else stage_module_paths(model, num_stages=pipeline[0], stage=pipeline[1])


def assert_same_where_materialised(model, reference) -> int:
    want = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.device.type == "meta":
            continue
        assert torch.equal(param, want[name]), name
        assert getattr(param, "tensor_model_parallel", False) == getattr(want[name], "tensor_model_parallel", False)
        checked += 1
    return checked


@pytest.mark.parametrize("model_name", list(MODELS))
def test_seeded_init_equals_the_dense_build(model_name, one_thread):
    preset, overrides = MODELS[model_name]
    source = resolve_model(ModelSpec(name=preset, overrides=overrides))
    dense = build_model(source, source.config, seed=7)
    for tp, rank, pipeline in PLACES:
        reference = shard_model(copy.deepcopy(dense), group=LayoutOnlyGroup(size=tp, rank=rank)) if tp > 1 else dense
        model, templates = sharded_meta(source.config, tp, rank)
        owned = owned_paths(model, pipeline)
        report = materialize(model, templates, SeededInit(model, seed=7), owned=owned)
        checked = assert_same_where_materialised(model, reference)
        everything = len(list(model.named_parameters(remove_duplicate=False)))
        assert checked == everything if pipeline is None else 0 < checked < everything, (tp, rank, pipeline)
        assert report.parameters == sum(p.numel() for p in model.parameters() if p.device.type != "meta")
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == (model_name != "llama"), "ties survive materialisation"


def save_pretrained(model_type: str, path):
    """A small random model, vocabulary not divisible by tp, saved as several safetensors files."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from transformers import AutoModelForCausalLM

    from dsframework.models.tiny import tiny_config

    torch.manual_seed(5)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    elif model_type == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=64, n_layer=3, n_head=4, n_positions=64))
    else:  # a type transformers' save renames (its conversion mapping, reversed)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=101))
    model.save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 3 and (path / "model.safetensors.index.json").is_file()
    return model


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "exaone"])
def test_sliced_loading_reads_only_this_ranks_share(tmp_path, model_type, one_thread):
    """Each place reads its slices and nothing else. GPT-NeoX and EXAONE are stored under the names
    transformers' save writes (`embed_out`, `transformer.h.N.attn.attention`), renamed as
    from_pretrained renames them."""
    saved = save_pretrained(model_type, tmp_path)
    if model_type in ("gpt_neox", "exaone"):
        stored = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
        assert stored - {name for name, _ in saved.named_parameters()}, "saved under other names than the model's"
    source = resolve_model(ModelSpec(name=str(tmp_path)))
    dense = build_model(source, source.config, seed=0)  # transformers' from_pretrained
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    for tp, rank, pipeline in PLACES:
        reference = shard_model(copy.deepcopy(dense), group=LayoutOnlyGroup(size=tp, rank=rank)) if tp > 1 else dense
        model, templates = sharded_meta(source.config, tp, rank)
        reader = PretrainedSlices.for_model(tmp_path, model)
        report = materialize(model, templates, reader, owned=owned_paths(model, pipeline))
        reader.close()
        assert assert_same_where_materialised(model, reference) > 0
        padding = sum(int((p.dense_index < 0).sum()) * p[0].numel() for p in model.parameters()
                      if getattr(p, "dense_index", None) is not None and not p.is_meta)  # vocab rows no file holds
        kept = 4 * (report.parameters - padding)  # fp32 on disk: what a rank reads is what it keeps, less padding
        assert 0.9 * kept <= report.bytes_read <= kept, (tp, rank, pipeline, report.bytes_read, kept)
        if tp * (pipeline or (1,))[0] > 1:
            assert report.bytes_read < 0.75 * on_disk, (tp, rank, pipeline)


def test_a_broken_pretrained_directory_is_named(tmp_path):
    save_pretrained("llama", tmp_path)
    config = resolve_model(ModelSpec(name=str(tmp_path))).config
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]

    wrong = copy.deepcopy(config)
    wrong.intermediate_size = 128
    with pytest.raises(UserError, match=r"has shape \[96, 64\], the config gives \[128, 64\]"):
        check_pretrained_files(tmp_path, wrong)

    (tmp_path / victim).rename(tmp_path / "moved.safetensors")
    with pytest.raises(UserError, match=f"{victim}.*is named by model.safetensors.index.json but is not there"):
        check_pretrained_files(tmp_path, config)
    assert (tmp_path / "moved.safetensors").is_file()  # nothing deleted


def test_buffers_are_real_on_a_meta_model():
    """Only parameters go to meta: rotary frequencies (buffers) are computed as in a dense build."""
    source = resolve_model(ModelSpec(name="tiny-llama"))
    model, dense = empty_model(source.config), build_model(source, source.config, seed=0)
    assert all(p.device.type == "meta" for p in model.parameters())
    for (name, buffer), (_, want) in zip(model.named_buffers(), dense.named_buffers()):
        assert buffer.device.type == "cpu" and torch.equal(buffer, want), name


def test_buffers_of_a_module_with_parameters_survive_the_seeded_init(one_thread):
    """Apertus' xIELU holds parameters (its alphas) and buffers (beta, eps): materialising its
    parameters must leave the buffers as built (they once came back as to_empty's garbage, and
    tp2/pp2 gave NaN logits), and the whole model must give the dense build's logits."""
    from dsframework.models.tiny import tiny_config

    config = tiny_config("apertus")
    source = resolve_model(ModelSpec(name="tiny-llama"))  # any random-init source: no pretrained_dir
    dense = build_model(source, config, seed=3)
    model, templates = sharded_meta(config, 1, 0)
    materialize(model, templates, SeededInit(model, seed=3))
    buffers = dict(model.named_buffers())
    xielu = [name for name in buffers if name.endswith("act_fn.beta")]
    assert xielu, "the tiny Apertus has xIELU activations"
    for name, want in dense.named_buffers():
        assert torch.equal(buffers[name], want), name
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense(input_ids=ids).logits)


def test_a_directory_transformers_converts_at_load_is_for_from_pretrained_only(tmp_path, one_thread):
    """transformers' own save_pretrained of a Qwen3-MoE stores each expert's gate/up/down apart
    (its conversion mapping fuses them at load): accepted for from_pretrained, refused in one line
    for tp/pp's sliced loading, which reads the model's own names."""
    from transformers import AutoModelForCausalLM

    from dsframework.models.construct import converted_at_load
    from dsframework.models.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert converted_at_load("qwen3_moe") and not converted_at_load("llama")
    check_pretrained_files(tmp_path, config)
    with pytest.raises(UserError, match=r"stores qwen3_moe's weights under the names transformers converts at load "
                                        r"\(no 'model.layers.0.mlp.experts.gate_up_proj'\).*use parallel.tp=1"):
        check_pretrained_files(tmp_path, config, sliced=True)
