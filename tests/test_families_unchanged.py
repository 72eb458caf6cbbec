"""Gathering each engine and trim into one family member changed no behaviour: the memory model's predictions for
every engine x trim x tp on the tiny models, and validation's verdict on every engine x trim x setting, equal what
the code before the move gave (tests/data/families_before.json, written once at commit 1ab59a1 by
`python tests/test_families_unchanged.py`).

Predictions are compared in full: weights and KV cache per rank, every tensor's placement, module changes, notes,
errors, the policy found, the host model. Validation: the error message, or the device and trim.env it resolves.
A change meant to alter them regenerates the fixture (`python tests/test_families_unchanged.py`) and says so."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "families_before.json"
GIB = 2**30

# (model overrides, tp values): the Llama and InternLM2 layouts, a tied head, fused qkv and gate-up, an embed_out
# head, MoE experts
MODELS = {
    "tiny": (["model=tiny"], (1, 2, 4)),
    "internlm2_tiny": (["model=internlm2_tiny"], (1, 2, 4)),
    "qwen2_tied": (["model=tiny_qwen2_tied"], (2,)),
    "phi3": (["model=tiny_phi3"], (2,)),
    "gpt_neox": (["model=tiny_gpt_neox"], (2,)),
    "mixtral": (["model=tiny_mixtral"], (2,)),
}
# engine settings: (label, config changes)
ENGINES = [
    ("autotp", {"engine": {"name": "init_inference"}}),
    ("autotp_parser", {"engine": {"name": "init_inference", "injection_policy": None}}),
    ("autotp_infer", {"engine": {"name": "init_inference", "injection_policy": "infer"}}),
    ("kernel", {"engine": {"name": "init_inference", "kernel_inject": True}}),
    ("zero3", {"engine": {"name": "zero_inference"}, "zero": {"name": "stage3", "stage": 3}}),
    ("zero3_offload", {"engine": {"name": "zero_inference"}, "zero": {"stage": 3, "offload": "cpu"}, "device": "cuda"}),
    ("autotp_zero3", {"engine": {"name": "autotp_zero3"}, "zero": {"name": "stage3", "stage": 3}}),
    ("autotp_zero3_parser", {"engine": {"name": "autotp_zero3", "injection_policy": None}, "zero": {"stage": 3}}),
    ("hf_tp", {"engine": {"name": "hf_tp"}}),
]
TRIMS = {
    "none": {},
    "dedupe": {"dedupe_buffers": True},
    "head": {"shard_head": True},
    "emb": {"shard_embedding": True},
    "world": {"world_group": True},
    "all": {"dedupe_buffers": True, "shard_head": True, "shard_embedding": True, "world_group": True},
}
# settings beyond engine x trim, on AutoTP with every trim (tiny and internlm2_tiny at tp=2)
EXTRA = {
    "meta": {"load": {"name": "meta"}},
    "sharded": {"load": {"name": "sharded"}},
    "ds_0.14": {"stack": {"deepspeed": "0.14.4"}},
    "ds_0.14_meta": {"stack": {"deepspeed": "0.14.4"}, "load": {"name": "meta"}},
    "fp32_convert": {"dtype": "fp32"},
    "cuda": {"device": "cuda"},
    "no_restore": {"load": {"restore_buffers": False}},
}


def compose(overrides: List[str]):
    from helpers.run import compose as compose_config

    return compose_config(overrides)


def config_of(overrides: List[str]) -> Dict[str, Any]:
    from dsexp.compose.config import to_schema

    return dataclasses.asdict(to_schema(compose(overrides)))


def merged(base: Dict[str, Any], *changes: Dict[str, Any]) -> Dict[str, Any]:
    out = json.loads(json.dumps(base))
    for change in changes:
        for key, value in change.items():
            if isinstance(value, dict):
                out[key] = {**(out.get(key) or {}), **value}
            else:
                out[key] = value
    return out


def prediction_cases() -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(case name, the result dict the memory model reads) for every engine x trim x tp, and the extra settings."""
    for model, (overrides, tps) in MODELS.items():
        base = config_of(overrides)
        for tp in tps:
            for engine, change in ENGINES:
                for trim, on in TRIMS.items():
                    yield f"{model}/tp{tp}/{engine}/{trim}", merged(base, change, {"trim": on, "tp": tp})
        if model in ("tiny", "internlm2_tiny"):
            for extra, change in EXTRA.items():
                yield f"{model}/tp2/autotp/all/{extra}", merged(base, {"trim": TRIMS["all"], "tp": 2}, change)


def summary(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Everything the memory model predicts for this configuration, in plain data."""
    from dsexp.analysis.memory import predict

    p = predict({"config": cfg, "runtime": {"device": cfg["device"] if cfg["device"] != "auto" else "cpu"}})
    placements = [
        [t.name, t.full, list(t.local), t.how, t.dim, t.is_buffer, t.copy] for t in p.placements
    ]  # the full list goes into a digest (the fixture stays small), its totals in the clear
    return {
        "weights": p.weights,
        "kv_cache": p.kv_cache,
        "tokens": p.tokens,
        "model_bytes": p.model_bytes,
        "placements": hashlib.sha1(json.dumps(placements).encode()).hexdigest(),
        "modules": p.modules,
        "notes": p.notes,
        "error": p.error,
        "policy": p.policy,
        "host": dataclasses.asdict(p.host),
    }


def validation_cases() -> Iterator[Tuple[str, List[str], int, Any]]:
    """(case name, overrides, visible GPUs, first GPU's bytes) over engine x kernel injection x trim x model x tp,
    the stack pins, ZeRO blocks, loads and ranks sharing a GPU."""
    engines = {
        "init_inference": [],
        "kernel": ["engine.kernel_inject=true"],
        "zero_inference": ["engine=zero_inference", "zero=stage3"],
        "zero_inference_nozero": ["engine=zero_inference"],
        "autotp_zero3": ["engine=autotp_zero3", "zero=stage3"],
        "hf_tp": ["engine=hf_tp"],
    }
    trims = {
        "none": [],
        "dedupe": ["trim.dedupe_buffers=true"],
        "head": ["trim.shard_head=true"],
        "emb": ["trim.shard_embedding=true"],
        "world": ["trim.world_group=true"],
        "all": ["trim=all"],
        "env": ["+trim.env.NCCL_MAX_NCHANNELS=8", "+trim.env.CUDA_MODULE_LOADING=LAZY"],
        "env_bad": ["+trim.env.HOME=/x"],
        "env_fixed": ["+trim.env.NCCL_NVLS_ENABLE=1"],
    }
    settings = {
        "cpu": ([], 0, None),
        "seed_stack": (["stack=seed"], 0, None),
        "old_transformers": (["stack.transformers=4.46.3"], 0, None),
        "old_deepspeed": (["stack.deepspeed=0.19.3"], 0, None),
        "meta": (["load=meta"], 0, None),
        "sharded": (["load=sharded"], 0, None),
        "shared_gpu": (["device=cuda", "launcher.gpus=1"], 2, 140 * GIB),
        "shared_gpu_small": (["device=cuda", "launcher.gpus=1"], 2, 1),
    }
    for model in ("tiny", "internlm2_tiny"):
        for tp in (1, 2, 4):
            for engine, e in engines.items():
                for trim, t in trims.items():
                    for setting, (s, gpus, total) in settings.items():
                        if setting != "cpu" and (tp != 2 or trim not in ("none", "all", "head", "emb")):
                            continue
                        overrides = [f"model={model}", f"tp={tp}", *e, *t, *s]
                        yield f"{model}/tp{tp}/{engine}/{trim}/{setting}", overrides, gpus, total


@functools.lru_cache(maxsize=None)
def _composed(overrides: Tuple[str, ...]):
    from dsexp.compose.config import to_schema

    return to_schema(compose(list(overrides)))


def job_config(overrides: List[str]):
    """The JobConfig these overrides compose to, built from one composition per model and per group option (Hydra
    takes ~0.2 s a composition): a group option (`engine=hf_tp`) replaces the group, `a.b=v` sets a field."""
    from omegaconf import OmegaConf

    model = next(o for o in overrides if o.startswith("model="))
    spec = copy.deepcopy(_composed((model,)))
    for o in overrides:
        key, value = o.lstrip("+").split("=", 1)
        if o == model:
            continue
        if "." not in key and key != "tp" and key != "device":  # a group option
            setattr(spec, key, copy.deepcopy(getattr(_composed((o,)), key)))
            continue
        *path, leaf = key.split(".")
        target = spec
        for part in path:
            target = getattr(target, part)
        parsed = OmegaConf.create({"v": value}).v if value not in ("true", "false") else value == "true"
        if isinstance(target, dict):
            target[leaf] = parsed
        else:
            setattr(target, leaf, int(parsed) if leaf in ("tp", "gpus") else parsed)
    return spec


def verdict(overrides: List[str], gpus: int, total: Any) -> Dict[str, Any]:
    from dsexp.compose.validate import validate
    from dsexp.core.schema import ConfigError

    try:
        spec = validate(job_config(overrides), gpus=gpus, gpu_total=total)
    except ConfigError as e:
        return {"error": str(e)}
    return {"device": spec.device, "env": dict(spec.trim.env), "shared_gpu": spec.shared_gpu}


def snapshot() -> Dict[str, Any]:
    return {
        "predictions": {name: summary(cfg) for name, cfg in prediction_cases()},
        "validation": {name: verdict(o, g, t) for name, o, g, t in validation_cases()},
    }


@pytest.fixture(scope="module")
def before() -> Dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _differences(want: Dict[str, Any], got: Dict[str, Any]) -> List[str]:
    return [
        f"{k}: was {want.get(k)!r}, now {got.get(k)!r}"
        for k in sorted(set(want) | set(got))
        if want.get(k) != got.get(k)
    ]


def test_predictions_unchanged(before):
    got = {name: json.loads(json.dumps(summary(cfg))) for name, cfg in prediction_cases()}
    assert not _differences(before["predictions"], got)


def test_validation_unchanged(before):
    got = {name: verdict(o, g, t) for name, o, g, t in validation_cases()}
    assert not _differences(before["validation"], got)


def one_case_a_line(snap: Dict[str, Dict[str, Any]]) -> str:
    """JSON with one line per case, so that a change reads as a line in a diff."""
    sections = [
        json.dumps(name)
        + ": {\n"
        + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(cases.items()))
        + "\n}"
        for name, cases in snap.items()
    ]
    return "{\n" + ",\n".join(sections) + "\n}\n"


if __name__ == "__main__":
    FIXTURE.write_text(one_case_a_line(snapshot()))
    print(f"wrote {FIXTURE}", file=sys.stderr)
