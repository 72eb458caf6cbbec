"""The seed's script (DeepSpeed issue #5793) with the configuration dsexp recommends, as lines a user adds.

    deepspeed --num_gpus N examples/seed_fixed.py /path/to/internlm2-chat-20b
    (CPU, to try it: DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/seed_fixed.py FOLDER)

Needs DeepSpeed 0.19.8 (VocabParallelEmbedding) and transformers >= 4.43 (no private copy per rank at load);
dsexp measures the same configuration as `experiment=autotp trim=all` (see docs/FINDINGS.md, sections 4-6).
"""

import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA is first used

import deepspeed  # noqa: E402
import torch  # noqa: E402
from accelerate import init_empty_weights  # noqa: E402
from deepspeed.inference.engine import InferenceEngine  # noqa: E402
from deepspeed.module_inject.layers import VocabParallelEmbedding  # noqa: E402
from deepspeed.module_inject.tp_shard import AutoTPMeta  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

path = sys.argv[1]
world = int(os.environ["WORLD_SIZE"])
deepspeed.init_distributed()
on_gpu = torch.cuda.is_available()
if on_gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, trust_remote_code=True).eval()

# 1. transformers >= 5 leaves the code's rotary tables uninitialised: recompute them from the model's own __init__
with init_empty_weights(include_buffers=False):
    twin = AutoModelForCausalLM.from_config(model.config, torch_dtype=torch.bfloat16, trust_remote_code=True)
for name, buf in twin.named_buffers():
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._buffers[leaf] = buf
rotary = {n: b for n, b in model.named_buffers() if b.dtype == torch.float32}  # init_inference casts them: keep

# 2. what AutoTP leaves whole on every GPU, with DeepSpeed's own layers
group = torch.distributed.group.WORLD
InferenceEngine.inference_mp_group = group  # world_group: DeepSpeed makes no second communicator
model.set_input_embeddings(  # shard_embedding: vocabulary rows split, while the table is still on the host
    VocabParallelEmbedding(
        model.get_input_embeddings(),
        group,
        name="model.tok_embeddings",
        tp_meta=AutoTPMeta.from_model_config(model.config, 64),
    )
)
model._modules["lm_head"] = model._modules["output"]  # shard_head: the head under the one name AutoTP splits
engine = deepspeed.init_inference(
    model,
    tensor_parallel={"tp_size": world},
    dtype=torch.bfloat16,
    replace_with_kernel_inject=False,  # no kernel policy exists for InternLM2: it would shard nothing
    injection_policy={type(model.model.layers[0]): ("attention.wo", "feed_forward.w2")},  # AutoTP's row-parallel
)  # no zero=...: init_inference never reads it
model = engine.module
model._modules["output"] = model._modules.pop("lm_head")  # DeepSpeed's LmHeadLinearAllreduce, back as `output`
for name, buf in rotary.items():  # the fp32 tables back (the cast moved the logits)
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._buffers[leaf] = buf.to(model.get_submodule(owner)._buffers[leaf].device)
first = {}  # dedupe_buffers: the 48 identical rotary tables share one tensor
for _, m in model.named_modules():
    for n, b in list(m._buffers.items()):
        if b is not None and n in m._non_persistent_buffers_set:
            f = first.setdefault((n, b.dtype, b.shape, b.stride(), b.device), b)
            if f is not b and torch.equal(f, b):
                m._buffers[n] = f
if on_gpu:
    torch.cuda.empty_cache()

ids = torch.tensor([[b % model.config.vocab_size for b in b"what is deepspeed?"]])
ids = ids.to(torch.cuda.current_device() if on_gpu else "cpu")
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # shared tensors once
held = sum(t.numel() * t.element_size() for t in unique) / 2**20
print(
    f"rank {torch.distributed.get_rank()}: {held:.2f} MiB of weights and buffers, tokens {out[0, -8:].tolist()}",
    flush=True,
)
