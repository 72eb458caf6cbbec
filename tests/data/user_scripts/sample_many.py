"""Several sampled answers per prompt (num_return_sequences), seeded the same on every rank."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

ap = argparse.ArgumentParser()
ap.add_argument("-m", "--model-path", required=True)
ap.add_argument("-n", "--num", type=int, default=3)
opts = ap.parse_args()

set_seed(1234)
tokenizer = AutoTokenizer.from_pretrained(opts.model_path)
model = AutoModelForCausalLM.from_pretrained(opts.model_path, torch_dtype=torch.float32)
model = deepspeed.init_inference(model, tensor_parallel={"tp_size": int(os.environ.get("WORLD_SIZE", 1))},
                                 dtype=torch.float32, replace_with_kernel_inject=False)
enc = tokenizer("Once upon a time", return_tensors="pt")
outs = model.generate(**enc, do_sample=True, top_p=0.9, temperature=0.8, max_new_tokens=7,
                      num_return_sequences=opts.num, pad_token_id=tokenizer.eos_token_id)
for i, o in enumerate(outs):
    print(i, tokenizer.decode(o, skip_special_tokens=True))
