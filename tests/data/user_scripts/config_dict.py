"""init_inference with everything in one config dict, as the DeepSpeed docs' JSON-style example."""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--prompt", default="The weather today")
    return p.parse_args()


if __name__ == "__main__":
    args = get_args()
    ds_config = {
        "tensor_parallel": {"tp_size": int(os.environ["WORLD_SIZE"])},
        "dtype": "fp32",
        "replace_with_kernel_inject": False,
    }
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, low_cpu_mem_usage=True)
    engine = deepspeed.init_inference(model, config=ds_config)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.inference_mode():
        output = engine.generate(**inputs, max_new_tokens=5, do_sample=False)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
