"""On a GPU machine: where a capped caching allocator runs out, batch by batch, in one process and in fresh ones.

    python3 benchmarks/fragmentation_probe.py --out DIR [--cap-gib 48] [--batches 1-24] [--trace 4,12] [--fresh]
    (campaign fragmentation: `make campaign NAME=fragmentation`)

A Llama at InternLM2-20B's dimensions (conf/model/llama_20b_shapes.yaml), bf16, built on the meta device and given
uninitialised GPU memory (`to_empty`: the weights' bytes and allocation order are what matter, not their values);
each rank's allocator capped with set_per_process_memory_fraction so the GPU stands in for a card of --cap-gib;
greedy generate of --new tokens after --prompt tokens, as dsexp's ranks call it. One load, every batch in turn: an
out-of-memory batch is caught, its memory released (empty_cache) and the next batch runs in the same process; with
--fresh the last batch that fit and the first that did not then run again, each in a fresh process. --expandable
sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch starts.
Writes DIR/probe.json (per batch: ok / oom, the allocator's reserved and allocated peaks, PyTorch's message) and
DIR/trace_b<B>.json.gz (the allocator's events of the weights and of that batch's generate, from
torch.cuda.memory._record_memory_history) for the batches named by --trace. Needs torch and transformers only.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

GIB = 2**30
# the dims of conf/model/llama_20b_shapes.yaml (read as text: no dsexp, Hydra or OmegaConf on the GPU machine)
DIMS = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/model/llama_20b_shapes.yaml").read_text())["dims"]


def batches(text: str):
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def build():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**DIMS, eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    return model.eval()


def generate(model, batch: int, prompt: int, new: int):
    import torch

    ids = torch.zeros((batch, prompt), dtype=torch.long, device="cuda")
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    del out, ids


def events():
    """The allocator's events since recording began, compact: [action, size, address] (segment_* included)."""
    import torch

    snap = torch.cuda.memory._snapshot()
    keep = ("alloc", "free_requested", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")
    return [[e["action"], e["size"], e["addr"]] for dev in snap["device_traces"] for e in dev if e["action"] in keep]


def point(model, batch: int, args, trace: bool):
    import torch

    torch.cuda.reset_peak_memory_stats()
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=400000, context=None)
    t0 = time.perf_counter()
    status, message = "ok", None
    try:
        generate(model, batch, args.prompt, args.new)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        status, message = "oom", str(e).splitlines()[0]
    gc.collect()
    row = {
        "batch": batch,
        "status": status,
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "allocated_peak": torch.cuda.max_memory_allocated(),
        "seconds": round(time.perf_counter() - t0, 2),
        "message": message,
    }
    if trace:
        path = Path(args.out) / f"trace_b{batch}{'_exp' if args.expandable else ''}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"weights": WEIGHTS, "generate": events()}, f)
        torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.empty_cache()
    return row


WEIGHTS = []


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cap-gib", type=float, default=48.0)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--batches", default="1-24")
    p.add_argument("--trace", default="", help="batches whose allocator events are written")
    p.add_argument("--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    p.add_argument("--fresh", action="store_true", help="then the boundary batches, each in a fresh process")
    p.add_argument("--stop-after-oom", type=int, default=2, help="batches measured past the first out of memory")
    args = p.parse_args()
    if args.expandable:  # before torch reads it
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    import transformers

    Path(args.out).mkdir(parents=True, exist_ok=True)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total, 0)
    traced = set(batches(args.trace)) if args.trace else set()
    if traced:
        torch.cuda.memory._record_memory_history(max_entries=400000, context=None)
    model = build()
    torch.cuda.synchronize()
    if traced:
        WEIGHTS.extend(events())
        torch.cuda.memory._record_memory_history(enabled=None)
    after_load = {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}
    rows, ooms = [], 0
    for b in batches(args.batches):
        rows.append(point(model, b, args, b in traced))
        print(json.dumps(rows[-1]), flush=True)
        ooms += rows[-1]["status"] == "oom"
        if ooms > args.stop_after_oom:
            break
    out = {
        "cap_bytes": int(args.cap_gib * GIB),
        "total_memory": total,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "prompt": args.prompt,
        "new": args.new,
        "after_load": after_load,
        "points": rows,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    name = f"probe_{args.batches.replace(',', '_')}{'_exp' if args.expandable else ''}.json"
    (Path(args.out) / name).write_text(json.dumps(out, indent=1) + "\n")
    if args.fresh:
        fresh(args, rows)
    return 0


def fresh(args, rows) -> None:
    """The last batch that fit and the first that ran out, each run again alone in a new process."""
    ok = [r["batch"] for r in rows if r["status"] == "ok"]
    oom = [r["batch"] for r in rows if r["status"] == "oom"]
    for batch in [b for b in (max(ok, default=None), min(oom, default=None)) if b is not None]:
        cmd = [sys.executable, __file__, "--out", args.out, "--cap-gib", str(args.cap_gib), "--prompt",
               str(args.prompt), "--new", str(args.new), "--batches", str(batch)]  # fmt: skip
        subprocess.run(cmd + (["--expandable"] if args.expandable else []), check=True)


if __name__ == "__main__":
    raise SystemExit(main())
