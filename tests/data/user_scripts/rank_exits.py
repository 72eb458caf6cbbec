"""Shard, generate; a rank whose output folder is not there prints why and stops with exit status 3.

torchrun --nproc_per_node 2 rank_exits.py --model /path/to/model
"""
import argparse
import os
import sys

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--out", default="outputs")
args = parser.parse_args()

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if rank == 0:
    os.makedirs(args.out, exist_ok=True)

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=torch.float32,
                                  replace_with_kernel_inject=False)
if not os.path.isdir(os.path.join(args.out, f"rank{rank}")) and rank != 0:
    print(f"rank {rank}: {args.out}/rank{rank} does not exist, giving up", file=sys.stderr)
    sys.exit(3)
inputs = tokenizer("Write the answer to a file:", return_tensors="pt")
out = engine.module.generate(**inputs, max_new_tokens=8, do_sample=False)
with open(os.path.join(args.out, "answer.txt"), "w") as f:
    f.write(tokenizer.decode(out[0], skip_special_tokens=True))
