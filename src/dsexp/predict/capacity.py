"""What fits above the weights, per rank: the KV cache, the prefill's activations, the logits, DeepSpeed's workspace.

A transformers Llama (InternLM2's published code keeps two tensors more: KEEPS) at a prefill of T = B x L tokens
holds, at its largest moment, tensors that every rank holds whole and tensors that shard with tp (read from
modeling_llama.py and checked against torch's CPU allocator events in tests/test_capacity.py). In units of
T x hidden x dtype bytes:
- every moment: the embedding's output (LlamaModel.forward keeps `inputs_embeds`), the layer's input (its caller
  keeps it) and the rotary tables (2 x T x head_dim);
- the MLP: the residual and the normed input whole, and gate's activation, up and their product, each T x
  intermediate/tp: 4 whole + 3 x intermediate/tp;
- an RMSNorm: it upcasts to fp32 twice and casts back (4 units at once) beside the residual: 7 whole, no split;
- SDPA attention: the normed input whole, the query, key, value and output split by heads;
- eager attention adds the scores, B x heads/tp x L x L in the dtype, four copies at once (the product, the
  scaled, the fp32 softmax counts two; five on CUDA in bf16: score_copies) and the B x L x L mask whole.
The KV cache holds the KV heads each rank keeps (all of them, replicated, where the engine does not split or tp
exceeds them); at the prefill's peak it holds L tokens (the last layer's MLP), at the end L + new - 1, and each
decode step concatenates one layer's keys (then values) into a new tensor while the old one is alive. generate
(transformers >= 4.45: `logits_to_keep=1`) computes the logits for the last token only: B x vocab in the dtype and
its fp32 copy, and the min-length processors' copies (`logits`). Each tensor is rounded as the caching allocator
hands it out (predict.allocator).

Kernel injection runs DeepSpeed's own kernels: its workspace (GenWorkSpace in
csrc/transformer/inference/includes/inference_context.h) holds the KV cache and the temporaries, sized at layer 0's
first forward for that batch and `max_out_tokens` tokens (fewer where free memory is short, keeping 500 MB back); a
prompt plus new tokens past `max_out_tokens` does not run (DeepSpeed #2485, #3758, #4506).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

from dsexp.predict import kv as kv_model
from dsexp.predict.allocator import replay

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MB = 2**20
WORKSPACE_KEPT_FREE = 500 * MB  # GenWorkSpace keeps this much free where more than 1 GiB is
# cuBLAS's workspace, through the caching allocator at the first GEMM and kept (torch's default on Hopper, 4 MiB x 8):
# every H200 point held 32 MiB more allocated after generate than after init
CUBLAS_WORKSPACE = 32 * MB


@dataclass
class Workload:
    batch: int
    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class Shapes:
    """The architecture numbers the memory above the weights depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type: str = ""  # whose decoder code: what it keeps beyond Llama's (KEEPS)
    full_logits: bool = False  # the prefill computes the logits at every position (generate's logits_to_keep dropped)

    @classmethod
    def of(cls, dims: Any) -> "Shapes":
        """From predict.architecture.Dims (or anything with the same fields)."""
        if not (getattr(dims, "hidden", 0) and getattr(dims, "heads", 0) and getattr(dims, "vocab", 0)):
            raise ValueError(
                f"{dims}: the memory above the weights needs hidden, intermediate, heads and vocab too; build the "
                "dims with dsexp.predict.architecture.dims(model)"
            )
        return cls(
            layers=dims.layers,
            hidden=dims.hidden,
            intermediate=dims.intermediate,
            heads=dims.heads,
            kv_heads=dims.kv_heads,
            head_dim=dims.head_dim,
            vocab=dims.vocab,
            model_type=getattr(dims, "model_type", "") or "",
            full_logits=bool(getattr(dims, "full_logits", False)),
        )


# What a decoder layer's code keeps alive beyond transformers' Llama (read from the code, measured on the CPU:
# tests/test_capacity.py). InternLM2's, as published: `attn, present = self.attention(...)` keeps the attention's
# output through the MLP, and `qkv = self.wqkv(...)` (the packed projection, q/k/v cut from it) stays bound through
# the attention. Its prefill caches the value as it was cut, a view of that projection: transformers 4.x stores it
# as given (a legacy tuple, or DynamicCache's first update), so each layer's whole packed qkv stays until the first
# decode step's cat copies the cache; 5.x copies it on the first store (cached_value_views_qkv).
KEEPS = {"internlm2": {"attention_output": True, "packed_qkv": True, "cached_value_views_qkv": True}}


def share(total: int, tp: int, rank: int) -> int:
    """Rank `rank`'s part of `total` heads (or rows) cut into tp parts, the first ones taking the remainder."""
    return total // tp + (1 if rank < total % tp else 0)


def alloc(nbytes: int, count: int = 1) -> int:
    """What `count` tensors of `nbytes` each take from the caching allocator (its rounding, allocated bytes)."""
    return replay([nbytes]).allocated * count if nbytes > 0 and count > 0 else 0


def rank_heads(s: Shapes, strategy: Any, tp: int, rank: int) -> Dict[str, int]:
    """Heads, KV heads and intermediate rows rank `rank` holds (predict.kv: replicated KV heads where tp exceeds
    them; all of them where the engine does not split the weights)."""
    splits = bool(strategy.splits_weights)
    if tp == 1 or not splits:
        return {"heads": s.heads, "kv_heads": s.kv_heads, "intermediate": s.intermediate}
    return {
        "heads": max(1, share(s.heads, tp, rank)),
        "kv_heads": kv_model.kv_heads(s.kv_heads, tp, rank, splits),
        "intermediate": share(s.intermediate, tp, rank),
    }


def kv_cache(s: Shapes, kv_heads: int, batch: int, tokens: int, e: int) -> int:
    """Keys and values of every layer: 2 x layers tensors of B x kv_heads x tokens x head_dim, as the caching
    allocator holds them."""
    return alloc(kv_tensor(s, kv_heads, batch, tokens, e), 2 * s.layers)


def kv_tensor(s: Shapes, kv_heads: int, batch: int, tokens: int, e: int) -> int:
    """One layer's keys (or values): their own bytes, without the allocator's rounding (what a CPU run counts)."""
    return batch * kv_heads * tokens * s.head_dim * e


def cache_at_end(s: Shapes, kv_heads: int, batch: int, prompt: int, new: int, e: int, strategy: Any = None) -> int:
    """The KV cache's own bytes when generate returns (prompt + new - 1 tokens; what a CPU run counts): quantized
    (strategy.kv_bits: dsexp.predict.kv's rule) or in the run dtype."""
    bits = getattr(strategy, "kv_bits", None)
    if not bits:
        return 2 * s.layers * kv_tensor(s, kv_heads, batch, prompt + new - 1, e)
    split = kv_model.split_tokens(prompt, new, strategy.kv_residual)
    return kv_model.cache_bytes(s.layers, kv_heads, s.head_dim, batch, split, bits, strategy.kv_group, e)


def prompt_cache(s: Shapes, held: Dict[str, int], w: Workload, e: int, pins_qkv: bool) -> int:
    """The prompt's KV cache after the prefill; where each cached value is a view of its layer's packed qkv
    (KEEPS, transformers 4.x), every layer holds its keys and that whole projection instead."""
    if not pins_qkv:
        return kv_cache(s, held["kv_heads"], w.batch, w.prompt_tokens, e)
    t = w.batch * w.prompt_tokens
    keys = alloc(t * held["kv_heads"] * s.head_dim * e)
    qkv = alloc(t * (held["heads"] + 2 * held["kv_heads"]) * s.head_dim * e)
    return s.layers * (keys + qkv)


def pins_packed_qkv(s: Shapes, strategy: Any) -> bool:
    """Whether the prefill's cache keeps each layer's packed qkv alive (KEEPS; the ranks' transformers before 5)."""
    before_5 = getattr(strategy, "transformers_before", None)
    return bool(KEEPS.get(s.model_type, {}).get("cached_value_views_qkv") and before_5 and before_5(5))


def score_copies(strategy: Any) -> int:
    """Copies of the attention scores eager attention holds at once: the scores, the fp32 softmax (two) and its cast
    back; on CUDA in bf16 also softmax's fp32 copy of its input (ATen upcasts only fp16 inside the kernel): the H200's
    InternLM2 runs at 2048 and 8192 tokens peaked at 5 copies, the CPU at 4."""
    on_cuda = str(getattr(strategy, "device", "cpu")).startswith("cuda")
    return 5 if on_cuda and strategy.dtype == "bf16" else 4


def prefill_moments(
    s: Shapes, held: Dict[str, int], w: Workload, e: int, attention: str, copies: int = 4
) -> Dict[str, Dict]:
    """{moment: {"whole": bytes, "split": bytes}} of a layer's largest moments at the prefill (module docstring)."""
    t, b, ln = w.batch * w.prompt_tokens, w.batch, w.prompt_tokens
    hid = alloc(t * s.hidden * e)
    base = 2 * hid + alloc(t * s.head_dim * e, 2)  # the embedding's output, the layer's input, cos and sin
    q = alloc(t * held["heads"] * s.head_dim * e)
    kv = alloc(t * held["kv_heads"] * s.head_dim * e)
    keeps = KEEPS.get(s.model_type, {})
    kept = hid if keeps.get("attention_output") else 0
    qkv = alloc(t * (held["heads"] + 2 * held["kv_heads"]) * s.head_dim * e) if keeps.get("packed_qkv") else 0
    moments = {
        "mlp": {"whole": base + 2 * hid + kept, "split": alloc(t * held["intermediate"] * e, 3)},
        "norm": {"whole": base + 5 * hid + kept, "split": 0},
        "attention": {"whole": base + hid, "split": 2 * q + 2 * kv + qkv},
    }
    if attention == "eager":
        scores = alloc(b * held["heads"] * ln * ln * e, copies)
        repeated = alloc(t * held["heads"] * s.head_dim * e, 2)  # repeat_kv's keys and values, all heads
        moments["attention"] = {"whole": base + hid + alloc(b * ln * ln * e), "split": q + repeated + scores + qkv}
    return moments


def logits(s: Shapes, batch: int, e: int, decode: bool) -> int:
    """The logits at their largest, as dsexp calls generate (greedy, min_new_tokens = new_tokens): the last token's
    logits (logits_to_keep=1) in the dtype, generate's fp32 copy, the two min-length processors' outputs and one's
    clone (fp32 each), their vocabulary index (int64) and EOS mask; a decode step also still holds the previous
    step's fp32 scores. Measured on the CPU: tests/test_capacity.py."""
    fp32 = alloc(batch * s.vocab * 4, 5 if decode else 4)
    return alloc(batch * s.vocab * e) + fp32 + alloc(s.vocab * 8) + alloc(s.vocab)


def workspace(s: Shapes, tp: int, batch: int, max_seq: int, e: int) -> int:
    """DeepSpeed's inference workspace (GenWorkSpace): (activations + attention scores + KV cache) x max_seq."""
    padded = 32 if s.head_dim <= 32 else 64 if s.head_dim <= 64 else 128
    width = s.heads * (s.head_dim if s.head_dim > 128 else padded)
    activation = 10 * width * batch
    temp = batch * (s.heads // tp) * max_seq
    cache = s.layers * batch * (width // tp) * 2
    return (activation + temp + cache) * max_seq * e


def above_weights(
    dims: Any, strategy: Any, tp: int, w: Workload, attention: Optional[str] = None
) -> Dict[str, List[int]]:
    """{term: bytes per rank} at the generate call's largest moment: kv_cache, activations_split,
    activations_whole, logits; with kernel injection the workspace (which holds the KV cache and the temporaries)
    and the logits. attention: the model's (dims.attention: "eager" keeps the scores; anything else, SDPA or flash
    kernels, does not); None: the dims'."""
    s, e = Shapes.of(dims), DTYPE_BYTES[strategy.dtype]
    if getattr(strategy, "last_position_logits", False):  # a trim gives the head the last position only
        s = replace(s, full_logits=False)
    attention = attention or getattr(dims, "attention", "sdpa")
    if getattr(strategy, "kernel_inject", False):
        max_seq = int(getattr(strategy, "max_out_tokens", 0) or 1024)
        return {
            "workspace": [workspace(s, tp, w.batch, max_seq, e)] * tp,
            "logits": [logits(s, w.batch, e, decode=w.new_tokens > 1)] * tp,
        }
    terms: Dict[str, List[int]] = {"kv_cache": [], "activations_split": [], "activations_whole": [], "logits": []}
    if str(getattr(strategy, "device", "cpu")).startswith("cuda"):
        terms["cublas_workspace"] = [CUBLAS_WORKSPACE] * tp
    pins = pins_packed_qkv(s, strategy)
    for rank in range(tp):
        held = rank_heads(s, strategy, tp, rank)
        for k, v in rank_peak(s, held, w, e, attention, score_copies(strategy), pins).items():
            terms[k].append(v)
    return {**terms, **quant_terms(s, strategy, tp, w, e)}


def quant_terms(s: Shapes, strategy: Any, tp: int, w: Workload, e: int) -> Dict[str, List[int]]:
    """What quantization changes above the weights (quant=, dsexp.quant), per rank:
    - kv_cache: a quantized cache (strategy.kv_bits) at its end, its tokens at their width and the newest ones in
      the run dtype; `kv_dequantized`: a decode step dequantizes one layer's keys and values and concatenates them
      with the new token (the dequantized and the concatenated tensors, keys and values: four at once);
    - dequantized: a weight-only member's forward dequantizes one weight at a time to the run dtype (the rank's
      largest: its share of the MLP's), DeepSpeed's gathers the whole weight first (the embedding's included);
    - act_quant: fp8 products quantize each linear's input to fp8 with a 4-byte scale per row (the prefill's widest:
      the MLP's down projection, its share of the intermediate); torchao's quantization (_quantize_affine_float8, as
      the GPU runs it without the mslk package) holds the input in float32, scaled and clamped at once, then its fp8
      copy (13 bytes an element). By then the gate's and up projection's outputs, two of the MLP's three that the
      layer's moment counts, are freed: on the H100 at 60 GiB (budget60_each) fp8 held 9 bytes an element of the
      down projection's input above that moment, at 35, 38 to 41 sequences alike."""
    out: Dict[str, List[int]] = {}
    bits = getattr(strategy, "kv_bits", None)
    if bits:
        heads = [rank_heads(s, strategy, tp, r)["kv_heads"] for r in range(tp)]
        out["kv_cache"] = [cache_at_end(s, h, w.batch, w.prompt_tokens, w.new_tokens, e, strategy) for h in heads]
        longest = w.prompt_tokens + w.new_tokens - 1
        out["kv_dequantized"] = [alloc(kv_tensor(s, h, w.batch, longest, e), 4) for h in heads]
    if getattr(strategy, "quantizes_activations", False):  # the prefill's widest linear input, in fp8 + its scales
        t = w.batch * w.prompt_tokens
        share = [rank_heads(s, strategy, tp, r)["intermediate"] for r in range(tp)]
        out["act_quant"] = [act_quant(t, i, s.hidden, e) for i in share]
    how = getattr(strategy, "dequantizes", None)
    if how == "gathered":
        out["dequantized"] = [alloc(max(s.vocab, s.intermediate) * s.hidden * e)] * tp
    elif how == "layer":
        share = [rank_heads(s, strategy, tp, r)["intermediate"] for r in range(tp)]
        out["dequantized"] = [alloc(i * s.hidden * e) for i in share]
    return out


def act_quant(tokens: int, intermediate: int, hidden: int, e: int) -> int:
    """fp8's input quantization at the prefill's widest linear input above the layer's moment: three float32 copies and
    the fp8 one, less the gate's and up projection's outputs (freed by then) where the widest is the down
    projection's input."""
    widest = max(intermediate, hidden)
    held = 3 * alloc(4 * tokens * widest) + alloc(tokens * widest) + alloc(tokens * 4)
    return held - (2 * alloc(e * tokens * intermediate) if intermediate >= hidden else 0)


def rank_peak(
    s: Shapes, held: Dict[str, int], w: Workload, e: int, attention: str, copies: int = 4, pins_qkv: bool = False
) -> Dict[str, int]:
    """The terms of one rank's largest moment: a layer's prefill peak (with the whole prompt's KV cache, as at
    the last layer), the prefill's logits, or the last decode step (the cache at its longest, one layer's keys
    being copied into a longer tensor, the logits). Where the prefill computes the logits at every position
    (Shapes.full_logits), they are B x L x vocab in the dtype and upcast to fp32 (InternLM2's forward does), and the
    fp32 ones stay alive into the first decode step (generate drops the prefill's outputs after it). pins_qkv: the
    prompt's cache holds each layer's packed qkv (prompt_cache) until the decode copies it."""
    moment = max(prefill_moments(s, held, w, e, attention, copies).values(), key=lambda m: m["whole"] + m["split"])
    kv_prompt = prompt_cache(s, held, w, e, pins_qkv)
    t = w.batch * w.prompt_tokens
    layer = {"kv_cache": kv_prompt, "activations_split": moment["split"], "activations_whole": moment["whole"]}
    head = {"kv_cache": kv_prompt, "logits": logits(s, w.batch, e, decode=False)}
    if s.full_logits:
        head = {
            "kv_cache": kv_prompt,
            "activations_whole": alloc(t * s.hidden * e),  # the final norm's output the head reads
            "logits": alloc(t * s.vocab * e) + alloc(t * s.vocab * 4),
        }
    longest = w.prompt_tokens + w.new_tokens - 1
    decode = {
        "kv_cache": kv_cache(s, held["kv_heads"], w.batch, longest, e),
        "activations_split": alloc(w.batch * held["kv_heads"] * longest * s.head_dim * e),  # the cat's new tensor
        "logits": logits(s, w.batch, e, decode=True) + (alloc(t * s.vocab * 4) if s.full_logits else 0),
    }
    moments = [layer, head] + ([decode] if w.new_tokens > 1 else [])
    top = max(moments, key=lambda t: sum(t.values()))
    return {k: top.get(k, 0) for k in ("kv_cache", "activations_split", "activations_whole", "logits")}


def peak_per_rank(weights_reserve: List[int], terms: Dict[str, List[int]]) -> List[int]:
    """Each rank's predicted peak: its weights' reserve plus every term above them."""
    return [w + sum(t[r] for t in terms.values()) for r, w in enumerate(weights_reserve)]


def limit_cause(strategy: Any, w: Workload) -> Optional[str]:
    """Why a workload cannot run whatever the memory: kernel injection's max_out_tokens exceeded."""
    max_out = int(getattr(strategy, "max_out_tokens", 0) or 1024)
    total = w.prompt_tokens + w.new_tokens
    if getattr(strategy, "kernel_inject", False) and total > max_out:
        return (
            f"prompt {w.prompt_tokens} + new {w.new_tokens} = {total} tokens exceed kernel injection's "
            f"max_out_tokens={max_out} (its workspace holds that many; raise engine.max_out_tokens)"
        )
    return None


def fits(dims, strategy, tp, weights_reserve: List[int], w: Workload, device_bytes: int, outside_bytes: int) -> bool:
    """Whether every rank's peak, plus the memory outside the allocator, stays within the device."""
    if limit_cause(strategy, w):
        return False
    return max(peak_per_rank(weights_reserve, fit_terms(dims, strategy, tp, w))) + outside_bytes <= device_bytes


def fit_terms(dims, strategy, tp: int, w: Workload) -> Dict[str, List[int]]:
    """The terms above the weights a fit check counts: `above_weights`, except under kernel injection, whose
    workspace shrinks to what is free, down to prompt + new tokens, plus what DeepSpeed keeps free."""
    if not getattr(strategy, "kernel_inject", False):
        return above_weights(dims, strategy, tp, w)
    s, e = Shapes.of(dims), DTYPE_BYTES[strategy.dtype]
    need = workspace(s, tp, w.batch, w.prompt_tokens + w.new_tokens, e) + WORKSPACE_KEPT_FREE
    return {"workspace": [need] * tp, "logits": [logits(s, w.batch, e, decode=w.new_tokens > 1)] * tp}


def largest_batch(
    dims,
    strategy,
    tp,
    weights_reserve: List[int],
    prompt_tokens,
    new_tokens,
    device_bytes: int,
    outside_bytes: int = 0,
    max_batch: int = 4096,
) -> int:
    """The largest batch (up to max_batch) whose every rank fits the device; 0 if not even batch 1 does. The
    peak grows with the batch, so a bisection finds it."""

    def ok(b: int) -> bool:
        w = Workload(b, prompt_tokens, new_tokens)
        return fits(dims, strategy, tp, weights_reserve, w, device_bytes, outside_bytes)

    if not ok(1):
        return 0
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
