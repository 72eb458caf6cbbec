"""Generate for every prompt of a file, twice: greedy, then sampled (argparse, a prompts file, two generate calls)."""
import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--prompts", required=True, help="one prompt per line")
parser.add_argument("--max-new-tokens", type=int, default=8)
args = parser.parse_args()

with open(args.prompts) as f:  # read first: no point loading a model without prompts
    prompts = [line.strip() for line in f if line.strip()]

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

world_size = int(os.environ.get("WORLD_SIZE", "1"))
tokenizer = AutoTokenizer.from_pretrained(args.model)
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=torch.float32,
                                  replace_with_kernel_inject=False)
batch = tokenizer(prompts, return_tensors="pt", padding=True)
greedy = engine.module.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False)
sampled = engine.module.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=20)
if int(os.environ.get("RANK", "0")) == 0:
    for text in tokenizer.batch_decode(greedy, skip_special_tokens=True):
        print(text)
