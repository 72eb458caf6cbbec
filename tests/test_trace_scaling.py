"""The fragmentation replay's generate traces: traced at two batches and scaled to the others, checked against a
third; traced at every batch where the check fails; shared by models of one structure (dsexp.predict.fragmentation);
a long generate built from its repeating decode steps (dsexp.predict.decode_steps)."""

from __future__ import annotations

import copy

import pytest
import yaml

from dsexp.predict import fragmentation
from dsexp.predict.meta_trace import generate_events

from helpers.run import ROOT

TINY = yaml.safe_load((ROOT / "conf" / "model" / "tiny_llama.yaml").read_text())["dims"]
PROMPT, NEW = 16, 4


@pytest.fixture
def model():
    from dsexp.predict import architecture as arch

    return copy.deepcopy(arch.meta_model({"arch": "llama", "dims": TINY}, "bf16"))


@pytest.fixture
def traces(monkeypatch):
    """Empty memos, and the batches the generate is traced at, in order."""
    monkeypatch.setattr(fragmentation, "_SCALED", {})
    monkeypatch.setattr(fragmentation, "_TRACES", {})
    monkeypatch.setattr(fragmentation, "_STEPS", {})
    monkeypatch.setattr(fragmentation, "_SEARCHES", {})
    batches = []

    def tracer(model, batch, *args, **kwargs):
        batches.append(batch)
        return generate_events(model, batch, *args, **kwargs)

    monkeypatch.setattr(fragmentation, "generate_events", tracer)
    return batches


def test_the_events_scaled_from_two_batches_are_the_events_traced_at_others(model, traces):
    assert fragmentation.traced(model, 5, PROMPT, NEW, False) == generate_events(model, 5, PROMPT, NEW)
    assert traces == [2, 3, 5]  # the two scaled, and the batch asked for checked
    for batch in (4, 9):
        assert fragmentation.traced(model, batch, PROMPT, NEW, False) == generate_events(model, batch, PROMPT, NEW)
    logits = generate_events(model, 7, PROMPT, NEW, output_logits=True)
    assert fragmentation.traced(model, 7, PROMPT, NEW, True) == logits
    assert traces == [2, 3, 5, 2, 3, 7]  # no batch traced again; the logits call scaled on its own


def test_batch_one_is_traced_its_generate_skips_the_padding_check_of_several_prompts(model, traces):
    one, two = generate_events(model, 1, PROMPT, NEW), generate_events(model, 2, PROMPT, NEW)
    assert len(one) < len(two)  # no scaling reaches it
    assert fragmentation.traced(model, 1, PROMPT, NEW, False) == one and traces == [1]


def test_where_the_batches_differ_in_their_events_every_batch_is_traced(model, traces, monkeypatch):
    tracer = fragmentation.generate_events

    def one_more_at_batch_2(model, batch, *args, **kwargs):
        events = tracer(model, batch, *args, **kwargs)
        return events + [("alloc", len(events), 512)] if batch == 2 else events

    monkeypatch.setattr(fragmentation, "generate_events", one_more_at_batch_2)
    assert fragmentation.traced(model, 6, PROMPT, NEW, False) == generate_events(model, 6, PROMPT, NEW)
    assert fragmentation.traced(model, 8, PROMPT, NEW, False) == generate_events(model, 8, PROMPT, NEW)
    assert traces == [2, 3, 6, 8]


def test_where_a_size_is_not_affine_in_the_batch_the_third_batch_finds_it_and_every_batch_is_traced(
    model, traces, monkeypatch
):
    tracer = fragmentation.generate_events

    def squared(model, batch, *args, **kwargs):
        (kind, key, n), *rest = tracer(model, batch, *args, **kwargs)
        return [(kind, key, n + batch * batch), *rest]

    monkeypatch.setattr(fragmentation, "generate_events", squared)
    events = fragmentation.traced(model, 4, PROMPT, NEW, False)
    assert events[0][2] == generate_events(model, 4, PROMPT, NEW)[0][2] + 16  # traced, not scaled (scaled: 14)
    fragmentation.traced(model, 9, PROMPT, NEW, False)
    assert traces == [2, 3, 4, 9]


def test_models_of_one_structure_share_a_trace_and_a_changed_one_does_not(model, traces):
    twin = copy.deepcopy(model)
    assert fragmentation.traced(model, 4, PROMPT, NEW, False) == fragmentation.traced(twin, 4, PROMPT, NEW, False)
    assert traces == [2, 3, 4]
    twin.model.layers[0].self_attn.num_key_value_groups = 1  # as AutoTP tells a module its heads: a new trace
    fragmentation.traced(twin, 4, PROMPT, NEW, False)
    hooked = copy.deepcopy(model)
    hooked.lm_head.register_forward_pre_hook(lambda head, args: None)
    fragmentation.traced(hooked, 4, PROMPT, NEW, False)
    assert traces == [2, 3, 4] * 3


@pytest.mark.parametrize("expandable", [False, True])
def test_the_largest_batch_and_its_probes_are_those_of_a_trace_per_batch(traces, monkeypatch, expandable):
    """Logits of 1 MiB a row and prompt: large blocks, so that the cap (60 MiB, 34 of them the weights and cuBLAS's
    workspace) finds a batch past several probes."""
    from dsexp.predict import architecture as arch

    model = arch.meta_model({"arch": "llama", "dims": {**TINY, "vocab_size": 8192}}, "bf16")
    weights, calls = fragmentation.apply_order(model), fragmentation.point_calls(NEW, logits=True)
    search = (model, weights, 64, calls, 60 * 2**20, 12, expandable)
    scaled = fragmentation.largest_batch(*search)
    # the generate: the two scaled, the first asked checked; the logits call: its own two and check, at batch 1 only
    assert len(scaled[1]) > 5 and traces == [2, 3, 12, 1]
    monkeypatch.setattr(fragmentation, "checked_scaling", lambda *args: None)
    monkeypatch.setattr(fragmentation, "_SCALED", {})
    monkeypatch.setattr(fragmentation, "_SEARCHES", {})  # the search made again, not the one it kept
    assert fragmentation.largest_batch(*search) == scaled


@pytest.fixture
def lengths(monkeypatch):
    """Empty memos, and the (batch, new tokens) the generate is traced at, in order."""
    for memo in ("_SCALED", "_TRACES", "_STEPS", "_SEARCHES"):
        monkeypatch.setattr(fragmentation, memo, {})
    made = []

    def tracer(model, batch, prompt, new, **kwargs):
        made.append((batch, new))
        return generate_events(model, batch, prompt, new, **kwargs)

    monkeypatch.setattr(fragmentation, "generate_events", tracer)
    return made


@pytest.mark.parametrize("new", [12, 30])
def test_a_long_generate_built_from_its_decode_steps_is_the_generate_traced(model, lengths, new):
    """Built from traces of 4, 5 and 6 new tokens, checked once at 8: the events, keys and sizes, of the trace."""
    from dsexp.predict.decode_steps import CHECK, FIRST

    assert fragmentation.traced(model, 1, PROMPT, new, False) == generate_events(model, 1, PROMPT, new)
    assert lengths == [(1, FIRST), (1, FIRST + 1), (1, FIRST + 2), (1, CHECK)]
    assert fragmentation.traced(model, 1, PROMPT, new + 7, False) == generate_events(model, 1, PROMPT, new + 7)
    assert len(lengths) == 4  # the steps are kept per model, prompt and batch


def test_scaled_in_the_batch_and_built_from_steps_at_once(model, lengths):
    """A long generate at a batch above 3: its batches 2 and 3 each built from their steps, then scaled."""
    assert fragmentation.traced(model, 5, PROMPT, 20, False) == generate_events(model, 5, PROMPT, 20)
    assert {new for _, new in lengths} == {4, 5, 6, 8} and {b for b, _ in lengths} == {2, 3, 5}


def test_steps_that_do_not_repeat_are_not_built_every_length_is_traced(model, lengths, monkeypatch):
    """Where the trace at 8 new tokens is not what the steps build (here: a size changed), the generate is traced."""
    from dsexp.predict import decode_steps

    real = decode_steps.Steps.at
    monkeypatch.setattr(decode_steps.Steps, "at", lambda self, new: [(k, key, n + 1) for k, key, n in real(self, new)])
    assert fragmentation.traced(model, 1, PROMPT, 14, False) == generate_events(model, 1, PROMPT, 14)
    assert lengths[-1] == (1, 14) and fragmentation._STEPS[next(iter(fragmentation._STEPS))] is None


def test_three_traces_without_one_repeating_step_give_none():
    from dsexp.predict.decode_steps import steps_of

    a = [("alloc", 0, 8), ("free", 0, 0)]
    b = a + [("alloc", 2, 8), ("free", 2, 0)]
    assert steps_of(a, b, b + [("alloc", 4, 8), ("free", 4, 0)]) is not None
    assert steps_of(a, b, b + [("alloc", 4, 8)]) is None  # steps of different lengths
    assert steps_of(a, b, b + [("alloc", 4, 8), ("free", 3, 0)]) is None  # a free of what no step made
    assert steps_of(a, b, b + [("free", 4, 0), ("alloc", 5, 8)]) is None  # another order


ARCHITECTURES = ["tiny_bloom", "tiny_falcon", "tiny_gemma", "tiny_gpt2", "tiny_gpt_neox", "tiny_gptj",
                 "tiny_mixtral", "tiny_olmoe", "tiny_opt", "tiny_phi3", "tiny_qwen2_moe", "tiny_qwen2_tied",
                 "internlm2_tiny"]  # fmt: skip


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_repeats_its_decode_steps_to_the_event(name):
    """The steps of 4, 5 and 6 new tokens build 12 exactly as traced: caches, MoE routing, ALiBi and InternLM2's
    remote code alike (at Qwen2.5-7B's shapes, by hand: 40 new tokens, 92,422 events, the same)."""
    from dsexp.predict import architecture as arch
    from dsexp.predict.decode_steps import steps_of

    conf = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    model = arch.meta_model({"arch": conf["arch"], "dims": conf["dims"]}, "bf16")
    steps = steps_of(*(generate_events(model, 2, PROMPT, n) for n in (4, 5, 6)))
    assert steps is not None and steps.at(12) == generate_events(model, 2, PROMPT, 12)


FAST_ARCHITECTURES = ("tiny_llama", "internlm2_tiny")  # the default suite's; the matrix's others are slow
EVERY_ARCHITECTURE = [
    pytest.param(name, marks=() if name in FAST_ARCHITECTURES else pytest.mark.slow)
    for name in ARCHITECTURES + ["tiny_llama"]
]


@pytest.mark.parametrize("name", EVERY_ARCHITECTURE)
def test_an_op_made_again_from_its_first_outputs_gives_the_events_of_its_kernel_run_every_time(name, monkeypatch):
    """The trace runs an op's meta kernel once per shapes and arguments and makes its outputs again after
    (meta_trace.dispatch_key): the events, keys and sizes, are those of every kernel run, caches, MoE routing, ALiBi
    and remote code alike, with the prefill's logits and at a batch whose ops were already seen."""
    from dsexp.predict import architecture as arch
    from dsexp.predict import meta_trace

    conf = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    model = arch.meta_model({"arch": conf["arch"], "dims": conf["dims"]}, "bf16")
    monkeypatch.setattr(meta_trace, "_OUTPUTS", {})
    made = [generate_events(model, b, PROMPT, 5, output_logits=True) for b in (2, 2, 3)]
    assert sum(v is not None for v in meta_trace._OUTPUTS.values()) > 10  # ops were made again, not run
    monkeypatch.setattr(meta_trace, "dispatch_key", lambda *args: None)
    assert made == [generate_events(model, b, PROMPT, 5, output_logits=True) for b in (2, 2, 3)]
