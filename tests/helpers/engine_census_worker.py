"""One rank under torchrun: place a model with a real engine on CPU, then write the measured weight census next to
the memory model's prediction for this rank. Usage: engine_census_worker.py MODE MODEL_DIR OUT_DIR
MODE: hf_tp (transformers TP plan), zero3 (ZeRO-3 via HfDeepSpeedConfig + deepspeed.initialize),
internlm2_policy (init_inference AutoTP with the InternLM2 injection policy on an InternLM2-layout module)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/
from dsexp.analysis.memory import predict
from dsexp.engines.placement import place  # noqa: E402
from dsexp.rank.probes.weights import resident_bytes, weight_census  # noqa: E402

from helpers.analysis_cases import INTERNLM2_POLICY, TINY, InternLM2ForCausalLM, config, result, strategy  # noqa: E402


def main(mode: str, model_dir: str, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # predicted first: a live HfDeepSpeedConfig would make even the meta build partition itself
    if mode == "internlm2_policy":
        with torch.device("meta"):
            meta = InternLM2ForCausalLM().to(torch.bfloat16)
        placements = place(meta, strategy(policy=INTERNLM2_POLICY), world)[0]
        predicted = sum(p.local[rank] for p in placements)
    else:
        cfg = config(
            world,
            TINY,
            engine="hf_tp" if mode == "hf_tp" else "zero_inference",
            zero="stage3" if mode == "zero3" else "none",
            stage=3 if mode == "zero3" else 0,
        )
        predicted = predict(result(cfg, [0] * world), world).weights[rank]
    model = build(mode, model_dir, world)
    census = weight_census(model)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {"predicted": predicted, "measured": resident_bytes(census, "cpu"), "classes": census["module_classes"]}
        )
    )


def build(mode: str, model_dir: str, world: int):
    import deepspeed
    from transformers import AutoModelForCausalLM

    if mode == "hf_tp":
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_size=world)
        )
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if mode == "zero3":
        from transformers.integrations import HfDeepSpeedConfig

        ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
        keep = HfDeepSpeedConfig(ds)  # noqa: F841  (from_pretrained partitions while this object lives)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        return deepspeed.initialize(model=model, config_params=ds)[0].module
    from deepspeed.inference.config import DeepSpeedTPConfig

    model = InternLM2ForCausalLM().to(torch.bfloat16)
    layer = type(model.model.layers[0])
    engine = deepspeed.init_inference(
        model,
        tensor_parallel=DeepSpeedTPConfig(tp_size=world),
        dtype=torch.bfloat16,
        replace_with_kernel_inject=False,
        injection_policy={layer: tuple(INTERNLM2_POLICY[layer.__name__])},
    )
    return engine.module


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
