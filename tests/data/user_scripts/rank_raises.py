"""Shard, then every rank checks its work before generating; the last rank finds none and raises.

deepspeed --num_gpus 2 rank_raises.py --model /path/to/model
"""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=torch.float32,
                                  replace_with_kernel_inject=False)

work = {0: ["What is tensor parallelism?"]}  # one prompt, meant for rank 0 only
if rank not in work:
    raise ValueError(f"rank {rank} has no prompts to answer")
inputs = tokenizer(work[rank], return_tensors="pt")
out = engine.module.generate(**inputs, max_new_tokens=8, do_sample=False)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
