"""The memory model above the weights (dsexp.predict.capacity) against what a transformers Llama allocates on the
CPU, counted from torch's allocator events (the profiler's memory records: every allocation and free of the CPU
allocator, in order), and against the figures the issue measured on the H200."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsexp.predict import capacity as cap
from dsexp.predict.architecture import Dims

GIB = 2**30


def strategy(tp_splits: bool = True, **kw):
    base = dict(dtype="bf16", splits_weights=tp_splits, kernel_inject=False, max_out_tokens=1024)
    return SimpleNamespace(**{**base, **kw})


def live_peak(model, inp, new_tokens: int) -> int:
    """The largest sum of live CPU allocations during one generate call (after a warm-up call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    kw = dict(
        attention_mask=torch.ones_like(inp),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(inp, **kw)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model.generate(inp, **kw)
    # an op's own allocations are on the op's event; frees (and allocations outside ops) are "[memory]" events
    events = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


CASES = {
    # (code, hidden, intermediate, heads, kv heads, layers, vocab, batch, prompt, new, attention): the moment that peaks
    "mlp": ("llama", 256, 1024, 8, 4, 2, 1024, 4, 256, 4, "sdpa"),
    "norm": ("llama", 256, 128, 8, 4, 2, 1024, 4, 256, 4, "sdpa"),
    "eager_scores": ("llama", 256, 1024, 8, 4, 2, 1024, 2, 512, 4, "eager"),
    "decode_logits": ("llama", 256, 512, 8, 8, 2, 32000, 4, 32, 8, "sdpa"),
    # InternLM2's code as published (dsexp's copy): eager, its packed qkv and the attention's output kept
    "internlm2_mlp": ("internlm2", 384, 1024, 6, 2, 2, 1024, 8, 64, 4, "eager"),
    "internlm2_scores": ("internlm2", 256, 1024, 8, 4, 2, 1024, 2, 256, 4, "eager"),
}


def build(code, hidden, inter, heads, kv, layers, vocab, attention):
    import torch

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=vocab,
    )
    if code == "internlm2":
        from dsexp.models.remote_code.internlm2.configuration_internlm2 import InternLM2Config
        from dsexp.models.remote_code.internlm2.modeling_internlm2 import InternLM2ForCausalLM

        model = InternLM2ForCausalLM(InternLM2Config(**sizes))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**sizes)
        cfg._attn_implementation = attention
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_the_peak_above_the_weights_is_what_the_models_code_allocates_on_the_cpu(case):
    import torch

    from dsexp.predict.architecture import dims as dims_of

    code, hidden, inter, heads, kv, layers, vocab, batch, prompt, new, attention = CASES[case]
    model = build(code, hidden, inter, heads, kv, layers, vocab, attention)
    measured = live_peak(model, torch.randint(0, vocab, (batch, prompt)), new)
    dims = dims_of(model)  # as the report builds them: the attention and the code from the model's config
    assert dims.attention == attention and dims.model_type == code
    terms = cap.above_weights(dims, strategy(), 1, cap.Workload(batch, prompt, new))
    predicted = cap.peak_per_rank([0], terms)[0]
    assert predicted == pytest.approx(measured, rel=0.05), terms
    # the KV cache term is exact: 2 x layers x kv heads x head_dim x tokens x batch x 2 bytes
    tokens = prompt + new - 1 if case == "decode_logits" else prompt
    assert terms["kv_cache"][0] == 2 * layers * kv * (hidden // heads) * tokens * batch * 2


def llama_7b_8_layers() -> Dims:
    """The issue's H200 model: hidden 4096, intermediate 11008, 8 layers, 32 heads, 8 KV heads."""
    return Dims(8, 8, 128, hidden=4096, intermediate=11008, heads=32, vocab=32000)


@pytest.mark.parametrize(
    "tp,batch,prompt,measured_gib",
    [(1, 32, 2048, 8.1), (1, 8, 2048, 2.05), (1, 32, 512, 2.05), (2, 32, 2048, 5.1)],
)
def test_the_issues_h200_figures(tp, batch, prompt, measured_gib):
    """Issue 33: fp16, 64 greedy tokens; the peak above the weights per rank (figures to the issue's precision)."""
    terms = cap.above_weights(llama_7b_8_layers(), strategy(dtype="fp16"), tp, cap.Workload(batch, prompt, 64))
    peak = max(cap.peak_per_rank([0] * tp, terms)) / GIB
    assert peak == pytest.approx(measured_gib, rel=0.05)


def test_the_intermediate_and_heads_split_while_hidden_size_tensors_stay_whole():
    w = cap.Workload(32, 2048, 64)
    one = cap.above_weights(llama_7b_8_layers(), strategy(), 1, w)
    two = cap.above_weights(llama_7b_8_layers(), strategy(), 2, w)
    assert two["activations_whole"][0] == one["activations_whole"][0]
    assert two["activations_split"][0] == pytest.approx(one["activations_split"][0] / 2, rel=0.01)
    assert two["kv_cache"][0] == pytest.approx(one["kv_cache"][0] / 2, rel=0.01)
    unsplit = cap.above_weights(llama_7b_8_layers(), strategy(tp_splits=False), 2, w)  # e.g. ZeRO-Inference
    assert unsplit["kv_cache"] == one["kv_cache"] * 2


def test_kv_heads_are_replicated_where_tp_exceeds_them():
    dims = Dims(8, 2, 128, hidden=4096, intermediate=11008, heads=32, vocab=32000)
    terms = cap.above_weights(dims, strategy(), 4, cap.Workload(1, 128, 2))
    one_head = 2 * 8 * 1 * 128 * 128 * 2
    assert terms["kv_cache"] == [one_head] * 4


def test_kernel_injection_workspace_and_its_token_limit():
    s = strategy(kernel_inject=True, dtype="fp16", max_out_tokens=1024)
    dims = llama_7b_8_layers()
    terms = cap.above_weights(dims, s, 2, cap.Workload(4, 512, 64))
    width = 32 * 128
    expected = (10 * width * 4 + 4 * 16 * 1024 + 8 * 4 * (width // 2) * 2) * 1024 * 2  # GenWorkSpace, by hand
    assert terms["workspace"] == [expected, expected]
    assert "max_out_tokens=1024" in cap.limit_cause(s, cap.Workload(1, 1000, 64))
    assert cap.limit_cause(s, cap.Workload(1, 900, 64)) is None
    assert cap.largest_batch(dims, s, 2, [2 * GIB] * 2, 1000, 64, 140 * GIB) == 0  # past max_out_tokens: nothing


def test_largest_batch_is_the_boundary_of_what_fits():
    dims, s = llama_7b_8_layers(), strategy(dtype="fp16")
    weights, device, outside = [int(3.13 * GIB)], 24 * GIB, GIB // 2
    b = cap.largest_batch(dims, s, 1, weights, 2048, 64, device, outside)
    assert b > 0

    def peak(batch):
        return max(cap.peak_per_rank(weights, cap.above_weights(dims, s, 1, cap.Workload(batch, 2048, 64))))

    assert peak(b) + outside <= device < peak(b + 1) + outside
    assert cap.largest_batch(dims, s, 1, [30 * GIB], 2048, 64, device) == 0
    assert cap.largest_batch(dims, s, 1, weights, 16, 1, 140 * GIB, max_batch=64) == 64


def test_dims_without_the_activation_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="predict.architecture.dims"):
        cap.above_weights(Dims(8, 8, 128), strategy(), 1, cap.Workload(1, 16, 2))


def test_internlm2s_prefill_caches_each_value_as_a_view_of_its_layers_packed_qkv():
    """capacity.KEEPS cached_value_views_qkv, read from dsexp's InternLM2 code: handed no Cache (transformers 4.42's
    generate for this remote code), its prefill returns values that keep the whole packed projection alive; the
    prompt_cache term is the storage the cache holds. transformers 5's DynamicCache copies them on the first store."""
    import torch
    from transformers import DynamicCache

    from dsexp.predict.architecture import dims as dims_of

    batch, prompt = 2, 16
    model = build("internlm2", 512, 512, 8, 2, 2, 256, "eager")
    ids = torch.randint(0, 256, (batch, prompt))
    with torch.no_grad():
        legacy = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
        cached = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, past_key_values=DynamicCache()
        )
    held = sum(t.untyped_storage().nbytes() for k, v in legacy for t in (k, v))
    s, w = cap.Shapes.of(dims_of(model)), cap.Workload(batch, prompt, 4)
    heads = {"heads": 8, "kv_heads": 2, "intermediate": 512}
    pinned, copied = cap.prompt_cache(s, heads, w, 2, pins_qkv=True), cap.prompt_cache(s, heads, w, 2, False)
    assert held == pinned and 2 * pinned == 7 * copied  # keys (1) + q, k, v of 4 query heads per KV head (6) vs 2
    values = [layer.values for layer in cached.past_key_values.layers]
    assert all(v.untyped_storage().nbytes() == v.numel() * 2 for v in values)
    assert cap.pins_packed_qkv(s, SimpleNamespace(transformers_before=lambda *v: (4, 42) < v))
    assert not cap.pins_packed_qkv(s, SimpleNamespace(transformers_before=lambda *v: (5, 24) < v))


def test_the_last_logits_trim_takes_internlm2s_prompt_logits_off_as_the_model_says():
    """trim.last_logits on InternLM2's code as published, which drops generate's logits_to_keep: its hook on the head
    leaves the logits of the last position only, and what the code then allocates on the CPU is the model's
    prediction with the trim (the logits term B x vocab, not B x L x vocab); the cut is the prompt's logits."""
    import torch

    from dsexp.predict.architecture import dims as dims_of
    from dsexp.trims.last_logits.rank import keep_last_logits

    batch, prompt, new, vocab = 4, 64, 4, 8192
    model = build("internlm2", 256, 512, 8, 4, 2, vocab, "eager")
    inp = torch.randint(0, vocab, (batch, prompt))
    dims = dims_of(model)
    assert dims.full_logits  # the published code computes every prompt position's logits
    w = cap.Workload(batch, prompt, new)
    whole = live_peak(model, inp, new)
    report = keep_last_logits(model)
    cut = live_peak(model, inp, new)
    assert report["applied"] and report["calls_cut"] == 2  # the two prefills live_peak ran
    terms = cap.above_weights(dims, strategy(last_position_logits=True), 1, w)
    assert cap.peak_per_rank([0], terms)[0] == pytest.approx(cut, rel=0.05), (terms, cut)
    untrimmed = cap.peak_per_rank([0], cap.above_weights(dims, strategy(), 1, w))[0]
    assert untrimmed == pytest.approx(whole, rel=0.05)
    assert whole - cut > batch * prompt * vocab * 6 * 0.8  # the prompt's logits in bf16 and fp32, gone
