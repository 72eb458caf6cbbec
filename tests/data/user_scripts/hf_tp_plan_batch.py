"""transformers' own tensor parallelism, as its docs show it: torchrun --nproc-per-node 2 hf_tp_plan_batch.py MODEL"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_id = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(model_id)
tokenizer.padding_side = "left"
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16, tp_plan="auto")
inputs = tokenizer(["Tensor parallelism splits", "A GPU has"], return_tensors="pt", padding=True).to(model.device)
out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print(tokenizer.batch_decode(out, skip_special_tokens=True))
