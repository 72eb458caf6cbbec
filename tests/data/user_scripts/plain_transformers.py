"""No DeepSpeed at all: plain transformers, started with torchrun like the rest (every rank runs the whole model).

torchrun --nproc_per_node 2 plain_transformers.py --model /path/to/model
"""
import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--max-new-tokens", type=int, default=12)
args = parser.parse_args()

local_rank = int(os.environ.get("LOCAL_RANK", 0))
device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
model.eval()

inputs = tokenizer(["My favourite GPU is"], return_tensors="pt").to(device)
with torch.no_grad():
    generated = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
print(f"[rank {local_rank}]", tokenizer.decode(generated[0], skip_special_tokens=True))
