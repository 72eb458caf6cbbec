"""No generation at all: the loss and perplexity of a text under the sharded model."""
import argparse
import math
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser(description="perplexity with tensor parallelism")
parser.add_argument("--model", required=True)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": int(os.getenv("WORLD_SIZE", "1"))},
                                  dtype=torch.float32, replace_with_kernel_inject=False)
text = "the quick brown fox jumps over the lazy dog " * 4
enc = tokenizer(text, return_tensors="pt")
with torch.no_grad():
    loss = engine(**enc, labels=enc["input_ids"]).loss
if int(os.getenv("RANK", "0")) == 0:
    print(f"loss {loss.item():.4f} perplexity {math.exp(loss.item()):.2f}")
