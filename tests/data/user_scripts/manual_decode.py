"""Greedy decoding written by hand (a loop of forward calls, no generate), with a KV cache."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
model = deepspeed.init_inference(model, tensor_parallel={"tp_size": int(os.environ["WORLD_SIZE"])},
                                 dtype=torch.float32, replace_with_kernel_inject=False).module
ids = tokenizer("Step by step", return_tensors="pt").input_ids
past = None
with torch.no_grad():
    for _ in range(args.steps):
        out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
        past = out.past_key_values
        ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=-1)
print(tokenizer.decode(ids[0]))
