"""A throughput check as users write one: the batch size, prompt length and new tokens on the command line, a batch
of prompts of exactly that length, AutoTP across the ranks, one generate call."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--prompt-tokens", type=int, default=32)
parser.add_argument("--new-tokens", type=int, default=8)
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
args = parser.parse_args()

world_size = int(os.getenv("WORLD_SIZE", "1"))
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
engine = deepspeed.init_inference(
    model, tensor_parallel={"tp_size": world_size}, dtype=torch.bfloat16, replace_with_kernel_inject=False
)
model = engine.module
device = next(model.parameters()).device

vocab = model.config.vocab_size
ids = torch.arange(args.batch_size * args.prompt_tokens).reshape(args.batch_size, args.prompt_tokens) % (vocab - 1) + 1
ids = ids.to(device)
with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                         min_new_tokens=args.new_tokens, do_sample=False)
if int(os.getenv("RANK", "0")) == 0:
    print(f"batch {args.batch_size}: generated {tuple(out.shape)}")
