"""A small inference service class: it makes its own process group, shards, answers a batch, then cleans up."""
import argparse
import os
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class Settings:
    model: str
    max_new_tokens: int = 6


class Generator:
    def __init__(self, settings: Settings):
        self.settings = settings
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(settings.model, torch_dtype=torch.float32)
        self.model = deepspeed.init_inference(model, tensor_parallel={"tp_size": self.world},
                                              dtype=torch.float32, replace_with_kernel_inject=False).module

    @torch.no_grad()
    def __call__(self, prompts):
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True)
        out = self.model.generate(**batch, max_new_tokens=self.settings.max_new_tokens, do_sample=False)
        return self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    gen = Generator(Settings(**vars(parser.parse_args())))
    answers = gen(["first question", "a second, longer question", "third"])
    dist.barrier()
    if gen.rank == 0:
        print(answers)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
