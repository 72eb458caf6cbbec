"""main() sets up torch.distributed itself, shards the model, generates, waits for every rank, tears the group down.

torchrun --nproc_per_node 2 own_group_main.py /path/to/model
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank


def main(model_path):
    rank, world_size, local_rank = setup()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        model = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=torch.float32)
        dist.barrier()  # everyone has its shard

        inputs = tokenizer("Distributed inference is", return_tensors="pt")
        if torch.cuda.is_available():
            inputs = inputs.to(f"cuda:{local_rank}")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        dist.barrier()
        if rank == 0:
            print(tokenizer.decode(output[0], skip_special_tokens=True))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
