"""A text-generation pipeline sharded with DeepSpeed (the pattern from DeepSpeed's inference tutorial)."""
import argparse
import os

import deepspeed
import torch
from transformers import pipeline

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--max-new-tokens", type=int, default=8)
args = parser.parse_args()

local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "1"))
generator = pipeline("text-generation", model=args.model, torch_dtype=torch.float32, device=-1)
generator.model = deepspeed.init_inference(generator.model, tensor_parallel={"tp_size": world_size},
                                           dtype=torch.float32, replace_with_kernel_inject=False)
string = generator("DeepSpeed is", do_sample=False, max_new_tokens=args.max_new_tokens)
if local_rank == 0:
    print(string)
