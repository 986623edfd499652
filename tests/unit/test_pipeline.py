"""HF -> pipeline conversion without processes: the layer specs, chained stage by stage as
DeepSpeed would build them, give HF's logits, loss and gradients; names map back to HF's.

Isolates conversion bugs from engine bugs (tests/distributed/test_pipeline.py runs the engine).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from dsframework.config import ModelSpec  # noqa: E402
from dsframework.errors import UserError  # noqa: E402
from dsframework.models.build import build_model, resolve_model  # noqa: E402
from dsframework.models.build import ModelSource  # noqa: E402
from dsframework.models.loss import causal_lm_loss  # noqa: E402
from dsframework.models.pipeline import (build_pipeline_module, is_decoder_layer,  # noqa: E402
                                           partition_layers, pipeline_layer_specs,
                                           pipeline_state_dict_to_hf, stage_table)

VOCAB, SEED = 64, 5


pytestmark = pytest.mark.usefixtures("one_thread")


def _preset(name: str, **overrides):
    source = resolve_model(ModelSpec(name=name, overrides={"vocab_size": VOCAB, **overrides}))
    return build_model(source, source.config, seed=SEED)


def _from_config(model_type: str, **fields):
    config = transformers.CONFIG_MAPPING[model_type](
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **fields)
    return build_model(ModelSource(config), config, seed=SEED)


MODELS = {
    "tiny-llama": lambda: _preset("tiny-llama"),                       # GQA, untied head
    "tiny-gpt2": lambda: _preset("tiny-gpt2"),                         # tied wte / lm_head
    "llama-tied": lambda: _preset("tiny-llama", tie_word_embeddings=True),
    "llama-eager": lambda: _eager(_preset("tiny-llama")),              # a real 4D mask, not sdpa's None
    "mistral-sliding": lambda: _from_config("mistral", sliding_window=4),
    "qwen2-sliding": lambda: _from_config("qwen2", use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1),        # full, sliding, sliding
}


def _eager(model):
    model.config._attn_implementation = "eager"
    return model


def _input_ids(batch: int = 3, seq: int = 12):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def run_stages(specs: list, parts: list[int], input_ids) -> list[tuple]:
    """The pipeline's forward without DeepSpeed: each stage builds its specs as PipelineModule does
    (a tied key once per stage); activations cross a stage boundary as fresh leaves, as over p2p.
    Returns (stage input, stage output) per stage."""
    x, stages = input_ids, []
    for stage in range(len(parts) - 1):
        if stage > 0:
            x = x.detach().requires_grad_()
        stage_input, tied = x, {}
        for spec in specs[parts[stage]:parts[stage + 1]]:
            if hasattr(spec, "key"):  # TiedLayerSpec
                module = tied.setdefault(spec.key, spec.build())
                x = spec.forward_fn(module, x) if spec.forward_fn else module(x)
            else:
                x = spec.build()(x)
        stages.append((stage_input, x))
    return stages


def backward_stages(stages: list[tuple], loss) -> None:
    """The engine's backward: the last stage from the loss, each earlier one from the grad of the
    next stage's input (what p2p sends back)."""
    loss.backward()
    for (_, output), (next_input, _) in reversed(list(zip(stages, stages[1:]))):
        output.backward(next_input.grad)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("method", ["parameters", "uniform"])
@pytest.mark.parametrize("name", list(MODELS))
def test_stages_equal_the_hf_model(name, method, num_stages):
    model = MODELS[name]()
    model.train()  # dropout is 0 in these configs; train mode is what the engine runs
    input_ids = _input_ids()
    want = model(input_ids=input_ids, labels=input_ids)
    want.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    specs = pipeline_layer_specs(model)
    parts = partition_layers(specs, num_stages, method)
    assert len(parts) == num_stages + 1 and parts[0] == 0 and parts[-1] == len(specs)
    assert all(start < stop for start, stop in zip(parts, parts[1:]))
    stages = run_stages(specs, parts, input_ids)
    logits = stages[-1][1]
    loss = causal_lm_loss(logits, input_ids)
    assert (logits - want.logits).abs().max().item() <= 1e-6
    assert abs(loss.item() - want.loss.item()) <= 1e-6

    # The stages reference the dense model's weights: every weight is in a stage, and its
    # gradient (summed over the tied copies) is HF's.
    assert {id(p) for spec in specs for p in spec.build().parameters()} == {id(p) for p in model.parameters()}
    backward_stages(stages, loss)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grads[n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_states_map_to_hf_names(name):
    """The per-layer state dicts (what layer_XX-model_states.pt holds) under HF names are exactly
    the model's state dict; and specs built from the config alone name the same tensors."""
    model = MODELS[name]()
    specs = pipeline_layer_specs(model)
    states = {idx: spec.build().state_dict() for idx, spec in enumerate(specs)
              if not getattr(spec, "forward_fn", None)}  # DeepSpeed writes no file for the tied head
    hf = pipeline_state_dict_to_hf(states, specs)
    want = model.state_dict()
    assert sorted(hf) == sorted(want)
    assert all(torch.equal(hf[k], want[k]) for k in want)
    model.load_state_dict(hf)  # strict: transformers takes it as is

    config_specs = pipeline_layer_specs(model.config)
    fresh = {idx: spec.build().state_dict() for idx, spec in enumerate(config_specs)}
    fresh_hf = pipeline_state_dict_to_hf(fresh, config_specs)
    assert sorted(fresh_hf) == sorted(want)
    assert all(fresh_hf[k].shape == want[k].shape for k in want)


def test_tied_embeddings_use_tied_layer_specs():
    from deepspeed.pipe import TiedLayerSpec

    for name, tied in (("tiny-gpt2", True), ("llama-tied", True), ("tiny-llama", False)):
        specs = pipeline_layer_specs(MODELS[name]())
        kinds = [isinstance(spec, TiedLayerSpec) for spec in specs]
        assert kinds == [tied, False, False, False, tied], name
        if tied:
            assert specs[0].key == specs[-1].key and specs[-1].forward_fn is not None


def test_loss_equals_hf_causal_lm_loss_with_ignored_labels():
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(2, 7, VOCAB, generator=torch.Generator().manual_seed(1))
    labels = _input_ids(2, 7)
    labels[0, 3:] = -100
    want = ForCausalLMLoss(logits, labels, vocab_size=VOCAB)
    assert torch.allclose(causal_lm_loss(logits, labels), want, atol=0, rtol=1e-7)


def test_partition_methods():
    specs = pipeline_layer_specs(MODELS["tiny-llama"]())  # embed, 2 layers, norm, head
    assert partition_layers(specs, 2, "uniform") == [0, 3, 5]
    assert partition_layers(specs, 2, "parameters") == [0, 2, 5]
    assert partition_layers(specs, 2, "type:DecoderLayer") == [0, 2, 5]  # one decoder layer each
    assert [is_decoder_layer(s) for s in specs] == [False, True, True, False, False]
    with pytest.raises(UserError, match="partition_method.*matches no layer type"):
        partition_layers(specs, 2, "type:NoSuchLayer")
    with pytest.raises(UserError, match="partition_method.*parameters, uniform or type"):
        partition_layers(specs, 2, "balanced")


def test_stage_table_lists_every_layer_once():
    specs = pipeline_layer_specs(MODELS["tiny-gpt2"]())
    table = stage_table(specs, partition_layers(specs, 2, "parameters"))
    for label in ("transformer.wte+wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
                  "lm_head (tied to wte)", "stage 0 total", "stage 1 total"):
        assert table.count(label) == 1, (label, table)
    assert "[tied:embed]" in table


def test_unsupported_architecture_names_the_fix():
    config = transformers.CONFIG_MAPPING["opt"](vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                ffn_dim=64, num_attention_heads=2)
    with pytest.raises(UserError, match="model.name='opt': cannot cut 'opt' into pipeline stages: it has no pipeline plan.*parallel.pp=1"):
        pipeline_layer_specs(config)


def test_build_pipeline_module_checks_before_deepspeed():
    """Errors a user can cause are caught before PipelineModule (which needs a process group)."""
    model = MODELS["tiny-llama"]()
    with pytest.raises(UserError, match=r"parallel.pp=0: must be >= 1"):
        build_pipeline_module(model, num_stages=0)
    with pytest.raises(UserError, match=r"parallel.pp=6: leaves stage 5 without layers.*choose pp <= 5"):
        build_pipeline_module(model, num_stages=6, partition_method="uniform")
    with pytest.raises(UserError, match=r"parallel.pp=6: leaves stage 5 without layers"):
        build_pipeline_module(model, num_stages=6, partition_method="type:DecoderLayer")
    with pytest.raises(UserError, match="activation_checkpoint_interval=-1: must be >= 0"):
        build_pipeline_module(model, num_stages=1, activation_checkpoint_interval=-1)
