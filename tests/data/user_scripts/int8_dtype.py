"""The seed-era way to ask DeepSpeed for int8 weights: init_inference(dtype=torch.int8) (DeepSpeed's 2022 docs)."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
args = parser.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": int(os.getenv("WORLD_SIZE", "1"))},
                                  dtype=torch.int8)
print(engine.module.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False))
