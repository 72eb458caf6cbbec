"""Where torchao's int4 weight-only kernel stops (issue 61): one linear quantized with quant=int4_weight's config, run
on M tokens in a process of its own per M (a CUDA illegal memory access poisons the process's context), M on both
sides of 2^31 output elements for a 16384-wide linear (llama_20b_shapes' MLP up-projection: 6144 -> 16384) and of
2^31 input elements for the down-projection (16384 -> 6144). The first GPU run (results/h200/quant/int4_limit.json)
called the int4 weight's dequantize for its reference, which torchao does not implement: no case reached the
kernel. Prints one JSON line per case and writes them to --out.

    python3 benchmarks/int4_limit.py --out $OUT/int4_limit.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

LIMIT = 2**31
CASES = [  # (in, out, tokens)
    (6144, 16384, LIMIT // 16384 - 1),  # output 2^31 - 16384 elements
    (6144, 16384, LIMIT // 16384),  # output exactly 2^31
    (6144, 16384, LIMIT // 16384 + 8192),  # batch 68 x 2048: past it
    (16384, 6144, LIMIT // 16384),  # input 2^31 elements, output 0.8e9
]


def one(inp: int, out: int, tokens: int) -> dict:
    import torch
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    lin = torch.nn.Sequential(torch.nn.Linear(inp, out, bias=False, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(tokens, inp, dtype=torch.bfloat16, device="cuda")
    # the last rows against the bf16 weight (torchao's int4 tensor has no dequantize): int4's own error is ~0.1, a
    # wrapped index gives garbage or a fault
    ref = x[-4:].float() @ lin[0].weight.float().t()
    quantize_(lin, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
    y = lin(x)
    torch.cuda.synchronize()
    err = ((y[-4:].float() - ref).norm() / ref.norm()).item()
    row = {"in": inp, "out": out, "tokens": tokens, "output_elements": tokens * out}
    return {**row, "ok": True, "last_rows_rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--one", nargs=3, type=int)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(*a.one)))
        return
    rows = []
    for inp, out, tokens in CASES:
        p = subprocess.run([sys.executable, __file__, "--one", str(inp), str(out), str(tokens)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if p.returncode == 0 and lines else {
            "in": inp, "out": out, "tokens": tokens, "output_elements": tokens * out, "ok": False,
            "rc": p.returncode, "error": (p.stderr.strip().splitlines() or [""])[-1][:300],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"limit_elements": LIMIT, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
