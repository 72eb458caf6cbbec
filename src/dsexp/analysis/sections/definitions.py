"""The "definitions" section: what each figure of the report means (units, peaks, the memory model's floor,
predictions at tp values not run)."""

from __future__ import annotations

from dsexp.analysis.sections.common import ReportInputs

NAME = "definitions"
DEFINITIONS = [
    "GiB = 2^30 bytes, MiB = 2^20 bytes. Per-GPU and per-rank figures are the maximum over ranks.",
    "per-GPU peak: NVML device memory used at its peak (includes the CUDA context and communicators).",
    "weights per GPU/rank: parameter + buffer bytes on the rank's compute device after init (census).",
    "predicted: the memory model from the model's config alone (dsexp.analysis.memory); the floor adds "
    "the KV cache for prompt + generated tokens and the device memory the run measured outside PyTorch's "
    "allocator (max over phases of NVML process used - torch reserved, plus the device's own reserve at "
    "`start`: CUDA context, communicator, workspaces; ranks sharing one GPU are held to their own process's "
    "peak, so their floor leaves the device's reserve out too).",
    "host peak / rank: RSS peak of one rank process (the kernel's high-water mark, VmHWM, read at each phase end: "
    "exact, whatever the sampler saw); node host peak: total - available memory of the machine, so everything on "
    "it counts, files in a tmpfs such as /dev/shm (split checkpoints) and other processes included (left out, "
    "`-`, for jobs packed with other jobs: `launcher.pack=true`); a budget search's host need is the node's growth "
    "over the job, its peak minus its used memory before launch.",
    "load_s / init_s / generate_s: a phase's wall time, the slowest rank's; shown only for a phase every rank "
    "ended (a phase cut short by a failure or a kill has no duration: its figures are `-`).",
    "tokens/s: tokens generated over their time. dsexp's own jobs: batch x new tokens x timed e2e calls over those "
    "calls' total time (every sequence of the batch counts; a grid: its fastest point). A user's "
    "script: every generate call rank 0 made, each sequence's new positions (batch rows x num_return_sequences x "
    "new tokens, padding after an early end of sequence included), over the sum of those calls' times; `-` where "
    "a call did not end.",
    "one-time cost (a user's script): time paid once and reused after, measured where it happened and left out "
    "of the phase it fell in: DeepSpeed compiling an op (torch's extensions cache keeps it for later runs), the "
    "script writing a checkpoint (save_pretrained); listed under the script's table.",
    "workload point: one (batch B, prompt of L tokens) of `generate.batch_size` x `generate.prompt_tokens`, its own "
    "phase (`generate[b=B,l=L]`), after `generate.warmup` untimed calls; tokens of a point = B x L (the prefill's).",
    "TTFT (time to first token): in each timed generate call, from its start to its first token (a logits "
    "processor's first call: the prompt's forward is done), as vLLM's benchmarks take it; CUDA events in stream "
    "order on a GPU, perf_counter on the CPU; `generate.repeats` calls.",
    "TPOT (time per output token): (e2e - TTFT) / (new tokens - 1) of the same call, one value per timed call.",
    "e2e (end to end): the time of one generate call of `generate.new_tokens` tokens; `generate.repeats` calls.",
    "p50 / p90 / p99: percentiles of the timed calls, linear interpolation between order statistics (numpy's "
    "default); with few calls p99 lies near the slowest.",
    "memory above the weights (capacity): per rank, the allocator's peak during a point's prefill or decode minus "
    "the weights allocated at init; predicted by dsexp.predict.capacity (KV cache, the prefill's activations split "
    "with tp and whole on every rank, the logits, DeepSpeed's workspace under kernel injection).",
    "out of memory (a point): the rank's torch.OutOfMemoryError, caught and recorded with the allocator's state; "
    "larger points at the same or longer prompt are skipped.",
    "tp values not run: the memory model at that tp (weights: sharded part / tp + replicated; KV cache), "
    "anchored on the largest tp that completed: + its measured memory outside PyTorch and activations/cache "
    "(peak - floor); host per rank = its peak RSS - the modelled load cost at its tp + the cost at the new "
    "tp (checkpoint pages mapped at once + private bytes, by loading strategy); node = used before launch + "
    "ranks x private bytes per rank (page cache is reclaimable, not counted). Failed runs anchor nothing.",
]


def render(inputs: ReportInputs) -> str:
    return "\n".join(["## Definitions", ""] + [f"- {d}" for d in DEFINITIONS] + [""])
