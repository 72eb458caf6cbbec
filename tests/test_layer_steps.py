"""A deep model's generate built from a trace of four of its decoder layers (dsexp.predict.layer_steps), as the
fragmentation replay builds it (dsexp.predict.fragmentation.generated): event for event the generate traced whole,
over the architecture matrix; checked once, and traced whole where the build differs."""

from __future__ import annotations

import copy

import pytest
import yaml

from dsexp.predict import fragmentation, layer_steps
from dsexp.predict.meta_trace import generate_events
from test_trace_scaling import EVERY_ARCHITECTURE

from helpers.run import ROOT

PROMPT, LAYERS = 16, 7


def deep(name: str, layers: int = LAYERS):
    """The preset's model with `layers` decoder layers (the presets have two)."""
    from dsexp.predict import architecture as arch

    conf = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    dims = {**conf["dims"], "num_hidden_layers": layers}
    return copy.deepcopy(arch.meta_model({"arch": conf["arch"], "dims": dims}, "bf16"))


@pytest.mark.parametrize("name", EVERY_ARCHITECTURE)
def test_a_generate_built_from_four_layers_is_the_generate_traced_whole(name):
    """Where the layers repeat (found: the dense decoders, MoE, ALiBi, InternLM2's remote code), the events of 7
    layers built from a trace of 4 are the trace of 7, keys and sizes, for a generate of several tokens and for the
    logits call; the model is left with its layers and config as they were."""
    model = deep(name)
    stack = layer_steps.decoder_layers(model)
    if name in ("tiny_llama", "internlm2_tiny", "tiny_gpt2", "tiny_mixtral", "tiny_qwen2_moe", "tiny_bloom"):
        assert stack is not None
    if stack is None:
        pytest.skip(f"{name}: its layers are not one list of alike layers; traced whole")
    for new, extra in ((4, {}), (1, {"output_logits": True})):
        template = layer_steps.traced(generate_events, model, stack, layer_steps.TEMPLATE, 2, PROMPT, new, **extra)
        assert layer_steps.built(template, LAYERS) == generate_events(model, 2, PROMPT, new, **extra)
    assert len(getattr(*stack)) == LAYERS == model.config.num_hidden_layers


def test_layers_that_differ_are_not_built():
    """A layer whose MLP is wider, or a config of sliding-window layers among full ones, is traced whole; so is a
    model of no more layers than the check traces."""
    import torch.nn as nn

    model = deep("tiny_llama")
    layers = getattr(*layer_steps.decoder_layers(model))
    wide = layers[3].mlp.up_proj
    layers[3].mlp.up_proj = nn.Linear(wide.in_features, wide.out_features * 2, bias=False, device="meta")
    assert layer_steps.decoder_layers(model) is None
    model = deep("tiny_llama")
    model.config.layer_types = ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    assert layer_steps.decoder_layers(model) is None
    assert layer_steps.decoder_layers(deep("tiny_llama", layer_steps.CHECK)) is None


@pytest.fixture
def memos(monkeypatch):
    for memo in ("_SCALED", "_TRACES", "_STEPS", "_LAYERED", "_SEARCHES"):
        monkeypatch.setattr(fragmentation, memo, {})


def test_the_build_is_checked_once_and_a_model_it_does_not_match_is_traced_whole(memos, monkeypatch):
    """The first generate of a model, prompt and logits checks the build against a trace of CHECK layers; later ones
    trace TEMPLATE layers only. Where the check finds another event, every generate of that model is traced whole:
    what it returns is the whole trace."""
    model = deep("tiny_llama")
    key = (fragmentation.fingerprint(model), PROMPT, 4, False)
    traced_layers = []

    def tracer(m, batch, prompt, new, marked=(), **extra):
        traced_layers.append(len(m.model.layers))
        return generate_events(m, batch, prompt, new, marked=marked, **extra)

    monkeypatch.setattr(fragmentation, "generate_events", tracer)
    whole = generate_events(model, 3, PROMPT, 4)
    assert fragmentation.generated(model, key, 2) == generate_events(model, 2, PROMPT, 4)
    assert fragmentation.generated(model, key, 3) == whole
    assert traced_layers == [layer_steps.TEMPLATE, layer_steps.CHECK, layer_steps.TEMPLATE]
    monkeypatch.setattr(fragmentation, "_LAYERED", {})
    monkeypatch.setattr(layer_steps, "built", lambda template, layers: template[:-1])  # a build that is wrong
    traced_layers.clear()
    assert fragmentation.generated(model, key, 3) == whole
    assert traced_layers == [layer_steps.TEMPLATE, layer_steps.CHECK, LAYERS]
    assert fragmentation._LAYERED == {(key[0], PROMPT, False): False}
