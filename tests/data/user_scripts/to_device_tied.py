"""Load, move to my device, shard with DeepSpeed, generate a small batch (a model whose head is tied to its embedding)."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser(description="tensor-parallel generation")
    parser.add_argument("--model", required=True, help="a local model folder")
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args()

    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model = model.to(device)
    model.eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world_size}, dtype=torch.float32, replace_with_kernel_inject=False
    )
    batch = torch.tensor([[2, 17, 33, 48], [2, 90, 91, 92]], device=device)
    with torch.no_grad():
        out = engine.module.generate(batch, max_new_tokens=args.new_tokens, do_sample=False)
    if local_rank == 0:
        print(out.tolist())


if __name__ == "__main__":
    main()
