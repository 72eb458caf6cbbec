"""Kernel injection, as most blog posts show it (fast kernels for a model DeepSpeed has a policy for)."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
model = deepspeed.init_inference(model, mp_size=int(os.getenv("WORLD_SIZE", "1")), dtype=torch.float32,
                                 replace_with_kernel_inject=True)
inputs = tokenizer("Kernel injection", return_tensors="pt")
print(tokenizer.decode(model.generate(inputs.input_ids, max_new_tokens=5, do_sample=False)[0]))
