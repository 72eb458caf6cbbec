"""Load in float32, cast to bfloat16 and move to the device in one call, then shard."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("model")
args = parser.parse_args()

device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model)
model = model.to(device, torch.bfloat16)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": int(os.environ["WORLD_SIZE"])},
                                  dtype=torch.bfloat16, replace_with_kernel_inject=False)
ids = tokenizer("Casting first", return_tensors="pt").input_ids.to(device)
print(engine.module.generate(ids, max_new_tokens=5, do_sample=False)[0].tolist())
