"""Generation on one rank: the prompt, the generate calls, and one workload point measured as the benchmarks do.

A point (batch B, prompt of L tokens; dsexp.core.workload) runs, after `generate.warmup` untimed calls:
- a memory run: one timed generate of `new_tokens` tokens whose window is split where the prefill ends (a logits
  processor's first call: the prompt's forward is done), giving the peaks during the prefill and during the decode
  (torch's allocator on a GPU, the sampler's host figures everywhere) and the KV cache's bytes at the end;
- `repeats - 1` more timed generates of `new_tokens` tokens (e2e);
- at the grid's first point only, one prefill of the first sequence alone (a generate of one new token,
  `CHECK_BATCH` sequences) that gives the first-step logits the correctness check and the NaN scan read (the other
  points' would be unread). The sequences of a point are one prompt repeated, so the first alone gives its logits;
  at the point's batch this call set the first point's reserved peak above what the same batch reached without it,
  and a search's first point measured another thing than its later ones (docs/FINDINGS.md 6e).
Each timed generate is also stamped at its first token (the logits processor's first call), so TTFT and TPOT come from
the same call as vLLM's benchmarks take them: TTFT = start to first token, TPOT = (e2e - TTFT) / (new_tokens - 1),
never negative. Two calls' times are never subtracted: over gloo on a shared GPU one call's prefill took longer than
another call's whole run. Times are CUDA events (read after a synchronize) on a GPU, perf_counter on the CPU;
tokens/s = B x new_tokens x timed calls / their total time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from dsexp.core.context import RankContext
from dsexp.core.tensors import stored_bytes_of
from dsexp.core.workload import CHECK_BATCH, Point, summary


def prompt_ids(ctx: RankContext, vocab_size: int) -> List[int]:
    """Token ids of the prompt: the folder's tokenizer if it has one, else the prompt's bytes mod vocab."""
    folder = Path(ctx.model_dir)
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=ctx.spec.model.trust_remote_code)
        return tok(ctx.spec.generate.prompt)["input_ids"]
    return [b % vocab_size for b in ctx.spec.generate.prompt.encode()]


def point_ids(text_ids: List[int], tokens: Optional[int]) -> List[int]:
    """A prompt of exactly `tokens` ids: the text's ids repeated and cut (None: the text's ids as they are).
    Deterministic, so every rank and the tp=1 reference get the same ids."""
    if tokens is None:
        return list(text_ids)
    reps = -(-tokens // max(1, len(text_ids)))
    return (list(text_ids) * reps)[:tokens]


class Clock:
    """Seconds between stamps: CUDA events on a GPU (recorded in stream order, read after a synchronize),
    perf_counter on the CPU."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu

    def stamp(self):
        import time

        import torch

        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self):
        import torch

        if self.on_gpu:
            torch.cuda.synchronize()

    def seconds(self, start, end) -> float:
        """Seconds from one stamp to a later one (after sync() on a GPU)."""
        return start.elapsed_time(end) / 1000.0 if self.on_gpu else end - start

    def time(self, fn: Callable[[], Any]):
        """(fn's result, seconds it took)."""
        self.sync()
        start = self.stamp()
        out = fn()
        end = self.stamp()
        self.sync()
        return out, self.seconds(start, end)


def cache_bytes(cache) -> Optional[int]:
    """Bytes of the key/value tensors a generate returned (a DynamicCache of transformers 5 or 4.x, or tuples)."""
    import torch

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                yield from tensors(x)

    if cache is None:
        return None
    if hasattr(cache, "layers"):  # a quantized layer (quant.kv) also holds its quantized keys and values
        found = [t for layer in cache.layers for t in (getattr(layer, k, None) for k in CACHE_TENSORS)]
    elif hasattr(cache, "key_cache"):
        found = [*cache.key_cache, *cache.value_cache]
    else:
        found = cache
    return sum(stored_bytes_of(t) for t in tensors(found))


# what a cache layer holds: keys and values (a quantized cache's residual, in the run dtype), and a quantized cache's
# quantized keys and values (transformers' QuantizedLayer)
CACHE_TENSORS = ("keys", "values", "_quantized_keys", "_quantized_values")


def make_split(on_split: Callable[[], None]):
    """A logits processor that calls `on_split` at its first call (the prefill's forward is done) and changes
    nothing."""
    from transformers import LogitsProcessor

    class PrefillEnd(LogitsProcessor):
        def __init__(self):
            self.called = False

        def __call__(self, input_ids, scores):
            if not self.called:
                self.called = True
                on_split()
            return scores

    return PrefillEnd()


def call_generate(module, inp, new_tokens: int, extra: Dict[str, Any], **kw: Any):
    """Greedy decode of exactly `new_tokens` tokens."""
    import torch

    from dsexp.core.workload import GREEDY

    with torch.no_grad():
        return module.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **GREEDY,
            **extra,
            **kw,
        )


def first_logits(out):
    """The first step's logits of the first sequence, fp32 on the CPU (a DTensor from a TP plan made whole)."""
    logits = out.logits[0][0]
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits.float().cpu()


def timed_generate(module, inp, n: int, extra: Dict[str, Any], clock: Clock, on_first: Callable[[], None] = None):
    """One greedy generate of `n` tokens stamped at its start, its first token (a logits processor's first call: the
    prompt's forward is done) and its end: (output, e2e seconds, TTFT seconds). `on_first` runs at the first token,
    after its stamp."""
    from transformers import LogitsProcessorList

    marks = []

    def at_first_token():
        marks.append(clock.stamp())
        if on_first is not None:
            on_first()

    procs = LogitsProcessorList([make_split(at_first_token)])
    clock.sync()
    start = clock.stamp()
    out = call_generate(module, inp, n, extra, logits_processor=procs)
    end = clock.stamp()
    clock.sync()
    # no stamp: the engine's generate never called the logits processors; no TTFT rather than a made-up one
    return out, clock.seconds(start, end), clock.seconds(start, marks[0]) if marks else None


def memory_run(module, inp, n: int, extra: Dict[str, Any], clock: Clock, split_window: Callable[[], Dict]):
    """One timed generate whose peaks are split at the prefill's end: (output, e2e seconds, TTFT seconds,
    {prefill: peaks, decode: peaks}). split_window (PhaseRecorder.split_window) closes the sampler's and, on a GPU,
    torch's peak windows."""
    windows: Dict[str, Dict[str, int]] = {}

    def at_prefill_end():
        windows["prefill"] = split_window()

    split_window()  # the prefill's window starts here
    out, e2e, ttft = timed_generate(module, inp, n, extra, clock, on_first=at_prefill_end)
    windows["decode"] = split_window()
    return out, e2e, ttft, windows


def measure_point(
    module,
    ctx: RankContext,
    point: Point,
    text_ids: List[int],
    extra: Dict[str, Any],
    split_window,
    logits: bool = True,
):
    """Run one workload point (module docstring); return (its record, the first-step logits (None unless `logits`),
    the tokens of the first sequence)."""
    import torch

    g = ctx.spec.generate
    n, clock = g.new_tokens, Clock(ctx.on_gpu)
    ids = point_ids(text_ids, point.prompt_tokens)
    inp = torch.tensor([ids] * point.batch, device=ctx.device if ctx.on_gpu else "cpu")
    for _ in range(g.warmup):
        call_generate(module, inp, n, extra)
    out, first_e2e, first_ttft, windows = memory_run(module, inp, n, extra, clock, split_window)
    produced = int(out.sequences.shape[1] - inp.shape[1]) * point.batch
    tokens = out.sequences[0, inp.shape[1] :].tolist()
    kv = cache_bytes(getattr(out, "past_key_values", None))
    del out
    e2e, ttft = [first_e2e], [first_ttft]
    for _ in range(g.repeats - 1):
        res, secs, first = timed_generate(module, inp, n, extra, clock)
        e2e.append(secs)
        ttft.append(first)
        del res
    check, first = {}, None
    if logits:
        res, secs = clock.time(lambda: call_generate(module, inp[:CHECK_BATCH], 1, extra, output_logits=True))
        check, first = {"logits_call": {"batch": CHECK_BATCH, "seconds": secs}}, first_logits(res)
        del res
    record = {
        **point.to_dict(),
        "prompt_len": len(ids),
        "new_tokens": n,
        "tokens_produced": produced,
        "kv_cache_bytes": kv,
        "prefill": windows.get("prefill", {}),
        "decode": windows.get("decode", {}),
        "latency": latency(ttft, e2e, point.batch, n, len(ids)),
        **check,
    }
    return record, first, tokens


def latency(ttft: List[float], e2e: List[float], batch: int, new_tokens: int, prompt_len: int) -> Dict[str, Any]:
    """TTFT, TPOT and e2e (mean, p50, p90, p99) of the timed calls (ttft[i] and e2e[i] from the same call), tokens/s
    (generated) and the prompt tokens/s of the prefill (its mean TTFT)."""
    pairs = [(f, t) for f, t in zip(ttft, e2e) if f is not None]  # None: a call without a first-token stamp
    stamped = [f for f, _ in pairs]
    tpot = [(t - f) / (new_tokens - 1) for f, t in pairs] if new_tokens > 1 else []
    total, mean_prefill = sum(e2e), sum(stamped) / len(stamped) if stamped else 0.0
    return {
        "ttft_s": ttft,
        "e2e_s": e2e,
        "ttft": summary(stamped),
        "tpot": summary(tpot),
        "e2e": summary(e2e),
        "tokens_per_s": batch * new_tokens * len(e2e) / total if total > 0 else None,
        "prefill_tokens_per_s": batch * prompt_len / mean_prefill if mean_prefill > 0 else None,
    }
