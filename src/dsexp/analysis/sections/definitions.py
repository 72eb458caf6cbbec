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
    "`start`: CUDA context, communicator, workspaces).",
    "host peak / rank: RSS peak of one rank process (the kernel's high-water mark, VmHWM, read at each phase end: "
    "exact, whatever the sampler saw); node host peak: total - available memory of the machine "
    "(left out, `-`, for jobs packed with other jobs: `launcher.pack=true`).",
    "load_s / init_s / generate_s: a phase's wall time, the slowest rank's; shown only for a phase every rank "
    "ended (a phase cut short by a failure or a kill has no duration: its figures are `-`).",
    "tokens/s: tokens generated over generate_s. dsexp's own jobs: generate.new_tokens of its one prompt. A user's "
    "script: every generate call rank 0 made, each sequence's new positions (batch rows x num_return_sequences x "
    "new tokens, padding after an early end of sequence included), over the sum of those calls' times; `-` where "
    "a call did not end.",
    "one-time cost (a user's script): time paid once and reused after, measured where it happened and left out "
    "of the phase it fell in: DeepSpeed compiling an op (torch's extensions cache keeps it for later runs), the "
    "script writing a checkpoint (save_pretrained); listed under the script's table.",
    "tp values not run: the memory model at that tp (weights: sharded part / tp + replicated; KV cache), "
    "anchored on the largest tp that completed: + its measured memory outside PyTorch and activations/cache "
    "(peak - floor); host per rank = its peak RSS - the modelled load cost at its tp + the cost at the new "
    "tp (checkpoint pages mapped at once + private bytes, by loading strategy); node = used before launch + "
    "ranks x private bytes per rank (page cache is reclaimable, not counted). Failed runs anchor nothing.",
]


def render(inputs: ReportInputs) -> str:
    return "\n".join(["## Definitions", ""] + [f"- {d}" for d in DEFINITIONS] + [""])
