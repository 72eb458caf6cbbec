"""Convert once, then serve: rank 0 saves the model in bf16 to a folder, every rank loads that copy and shards it."""
import argparse
import os
import tempfile

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), f"bf16-copy-{os.getenv('MASTER_PORT', '0')}"))
args = parser.parse_args()

deepspeed.init_distributed()
rank = dist.get_rank()
if rank == 0 and not os.path.isfile(os.path.join(args.out, "config.json")):
    AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.model).save_pretrained(args.out)
dist.barrier()
tokenizer = AutoTokenizer.from_pretrained(args.out)
model = AutoModelForCausalLM.from_pretrained(args.out, torch_dtype=torch.bfloat16)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": dist.get_world_size()}, dtype=torch.bfloat16,
                                  replace_with_kernel_inject=False)
ids = tokenizer("bf16 on every rank", return_tensors="pt").input_ids
print(rank, engine.module.generate(ids, max_new_tokens=5, do_sample=False).tolist())
