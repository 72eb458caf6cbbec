"""Users' inference scripts as users write them (not dsexp's examples), for the script workload's tests and the GPU
runs: the seed's main.py verbatim (tests/data/seed_main.py) with only its model path replaced, and small scripts
with the lines the public threads show (a zero= block with AutoTP, pipeline(device=...), transformers' tp_plan, a
rank that raises, the model moved to the device before init_inference)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

SEED = Path(__file__).resolve().parents[1] / "data" / "seed_main.py"
SEED_PATH = "/mnt/sgnfsdata/tolo-03-97/pretrained_models/internlm2-chat-20b"

SCRIPTS = {
    # AutoTP on a model DeepSpeed's parser knows, with a ZeRO block init_inference never reads
    "zero_autotp.py": """
        import os, torch, deepspeed
        from transformers import AutoModelForCausalLM
        world = int(os.getenv("WORLD_SIZE", "1"))
        model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.bfloat16)
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.bfloat16,
                                          replace_with_kernel_inject=False, zero={"stage": 3})
        ids = torch.tensor([[1, 5, 9, 13]])
        print(engine.module.generate(ids, max_new_tokens=4, do_sample=False).tolist())
    """,
    # a transformers pipeline placed on the rank's device before init_inference (on CPU the device is the host)
    "pipeline_tp.py": """
        import os, torch, deepspeed
        from transformers import pipeline
        local_rank, world = int(os.getenv("LOCAL_RANK", "0")), int(os.getenv("WORLD_SIZE", "1"))
        device = local_rank if torch.cuda.is_available() else -1
        pipe = pipeline("text-generation", model=MODEL, torch_dtype=torch.bfloat16, device=device)
        pipe.model = deepspeed.init_inference(pipe.model, tensor_parallel={"tp_size": world},
                                              dtype=torch.bfloat16, replace_with_kernel_inject=False).module
        print(pipe("what is deepspeed?", max_new_tokens=4, do_sample=False)[0]["generated_text"])
    """,
    # transformers' own tensor parallelism, no DeepSpeed
    "hf_tp_plan.py": """
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16, tp_plan="auto")
        ids = torch.tensor([[1, 5, 9, 13]]).to(model.device)
        print(model.generate(ids, max_new_tokens=4, do_sample=False).tolist())
    """,
    # a rank that raises after loading
    "raises.py": """
        import os, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.bfloat16)
        if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
            raise RuntimeError("the last rank gives up")
    """,
    # the model placed on the rank's device by device_map before init_inference (device_map="auto" on CPU)
    "device_map.py": """
        import os, torch, deepspeed
        from transformers import AutoModelForCausalLM
        local_rank, world = int(os.getenv("LOCAL_RANK", "0")), int(os.getenv("WORLD_SIZE", "1"))
        device_map = {"": local_rank} if torch.cuda.is_available() else "auto"
        model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.bfloat16, device_map=device_map)
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.bfloat16,
                                          replace_with_kernel_inject=False)
        ids = torch.tensor([[1, 5, 9, 13]]).to(engine.module.device)
        print(engine.module.generate(ids, max_new_tokens=4, do_sample=False).tolist())
    """,
    # the model moved to the GPU with .cuda() before init_inference (CPU: .to("cpu"), a move to the device)
    "moves_first.py": """
        import os, torch, deepspeed
        from transformers import AutoModelForCausalLM
        world = int(os.getenv("WORLD_SIZE", "1"))
        model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.bfloat16, trust_remote_code=True)
        model = model.cuda() if torch.cuda.is_available() else model.to("cpu")
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.bfloat16,
                                          replace_with_kernel_inject=True)
        ids = torch.tensor([[1, 5, 9, 13]]).to(engine.module.device)
        print(engine.module.generate(ids, max_new_tokens=4, do_sample=False).tolist())
    """,
}


def write_seed_main(folder: Path, model_dir: str) -> Path:
    """The seed's main.py exactly as its author wrote it, its model path aside."""
    text = SEED.read_text()
    assert SEED_PATH in text
    out = Path(folder) / "main.py"
    out.write_text(text.replace(SEED_PATH, str(model_dir)))
    return out


def write_script(folder: Path, name: str, model_dir: str) -> Path:
    out = Path(folder) / name
    out.write_text(f"MODEL = {str(model_dir)!r}\n" + textwrap.dedent(SCRIPTS[name]).lstrip())
    return out


if __name__ == "__main__":  # a campaign's step: user_scripts.py FOLDER main.py|NAME MODEL_DIR (the seed's or another)
    folder, name, model_dir = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    folder.mkdir(parents=True, exist_ok=True)
    print(write_seed_main(folder, model_dir) if name == "main.py" else write_script(folder, name, model_dir))
