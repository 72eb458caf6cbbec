"""Four prompts of different lengths in one left-padded batch, sharded with DeepSpeed's AutoTP.

deepspeed --num_gpus 2 padded_batch.py --model_name /path/to/model
"""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name", required=True)
parser.add_argument("--max_new_tokens", type=int, default=20)
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
args = parser.parse_args()

world_size = int(os.getenv("WORLD_SIZE", "1"))
device = torch.device(f"cuda:{args.local_rank}") if torch.cuda.is_available() else torch.device("cpu")

tokenizer = AutoTokenizer.from_pretrained(args.model_name, padding_side="left")
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

model = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype="auto")
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=model.dtype,
                                  replace_with_kernel_inject=False)

prompts = [
    "DeepSpeed is",
    "The capital of France is",
    "Once upon a time, in a land far far away, there lived",
    "Hi",
]
inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
with torch.inference_mode():
    outputs = engine.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)

if args.local_rank == 0:
    for prompt, text in zip(prompts, tokenizer.batch_decode(outputs, skip_special_tokens=True)):
        print(f"{prompt!r} -> {text!r}")
