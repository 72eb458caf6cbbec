# an older script: mp_size= and dtype=torch.float, the model moved to the device first
import os
import sys

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "1"))
device = "cuda:%d" % local_rank if torch.cuda.is_available() else "cpu"

tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
model.to(device)
model = deepspeed.init_inference(model, mp_size=world_size, dtype=torch.float, replace_with_kernel_inject=False)
ids = tok("Hello, my name is", return_tensors="pt").input_ids.to(device)
print(tok.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0]))
