"""Loading strategies, in one process on CPU: each pitfall of DeepSpeed's meta path and the fix for it.

DeepSpeed's own code is exercised where it decides (Loading, replace_module, init_inference at tp=1);
tp>1 needs ranks and is covered by test_loading_sweep.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.context import RankContext
from dsexp.core.schema import ConfigError
from dsexp.job import split as split_mod
from dsexp.models.writer import ensure_checkpoint
from dsexp.rank.loading import buffers, files, meta
from dsexp.rank.loading.eager import from_pretrained

from helpers.run import compose


@pytest.fixture(scope="module", autouse=True)
def cpu_accelerator():
    """DeepSpeed's CPU accelerator for these in-process tests where none is named (it is chosen at DeepSpeed's first
    use); the variable as it was after them (set at import, it held for every test its worker ran)."""
    before = os.environ.get("DS_ACCELERATOR")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    yield
    if before is None:
        os.environ.pop("DS_ACCELERATOR", None)


def _spec(overrides=()):
    return to_schema(compose(["model=tiny", *overrides]))


@pytest.fixture(scope="module")
def tiny(cache_dir):
    spec = _spec()
    m = spec.model
    return ensure_checkpoint(str(cache_dir), m.name, m.arch, m.dims, m.dtype, "safetensors", m.seed, m.shard_mb).path


def _ctx(tiny, tmp_path, world_size=1, overrides=()):
    return RankContext(_spec(overrides), 0, 0, world_size, tmp_path, tiny, {"device": "cpu"})


@pytest.fixture(scope="module")
def eager_model(tiny, tmp_path_factory):
    return from_pretrained(_ctx(tiny, tmp_path_factory.mktemp("e"))).eval()


def _logits(model):
    ids = torch.tensor([[b % model.config.vocab_size for b in b"what is deepspeed?"]])
    with torch.no_grad():
        return model(ids).logits[0, -1].float()


def test_meta_build_has_params_on_meta_and_buffers_computed(tiny, tmp_path, eager_model):
    model = meta.build_on_meta(_ctx(tiny, tmp_path))
    assert all(p.is_meta for p in model.parameters())
    got = buffers.non_persistent_buffers(model)
    want = buffers.non_persistent_buffers(eager_model)
    assert set(got) == set(want) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for name, buf in got.items():
        assert buf.dtype == torch.float32 and torch.equal(buf, want[name])


def test_rope_buffers_are_in_no_checkpoint_and_deepspeed_would_leave_them_empty(tiny):
    """The premise: DeepSpeed's Loading.load_buffer swaps a meta buffer it finds in no file for torch.empty."""
    from deepspeed.module_inject.auto_tp import Loading
    from transformers import AutoConfig, AutoModelForCausalLM

    names = {n for p in files.checkpoint_files(tiny, "safetensors") for n in files.tensor_names(p)}
    assert not any("inv_freq" in n for n in names) and "model.norm.weight" in names
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny)))
    rot = model.model.rotary_emb
    allocs = []
    real_empty_like = torch.empty_like

    def spy(*args, **kwargs):
        allocs.append(args[0].shape)
        return real_empty_like(*args, **kwargs)

    torch.empty_like = spy
    try:
        Loading.load_buffer(rot, {}, "model.rotary_emb.")
    finally:
        torch.empty_like = real_empty_like
    assert not rot.inv_freq.is_meta and len(allocs) == 2  # both buffers: uninitialised memory, nothing copied


def test_restore_undoes_engine_cast_and_uninitialised_buffers(tiny, tmp_path, eager_model):
    model = meta.build_on_meta(_ctx(tiny, tmp_path))
    originals = buffers.snapshot(model)
    model.bfloat16()  # what init_inference(dtype=bf16) does to every buffer
    model.model.rotary_emb._buffers["original_inv_freq"] = torch.full((32,), float("nan"))  # as to_empty leaves it
    report = buffers.restore(model, originals, "cpu")
    assert report["restored"] == {
        "model.rotary_emb.inv_freq": "cast",
        "model.rotary_emb.original_inv_freq": "nonfinite",
    }
    rot = model.model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq, eager_model.model.rotary_emb.inv_freq)
    assert buffers.restore(model, originals, "cpu")["restored"] == {}


def _rename_norms(model, new_name):
    """Give every LlamaRMSNorm a class DeepSpeed's Loading.is_load_module does not list (like InternLM2RMSNorm)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cls = type(new_name, (LlamaRMSNorm,), {})
    for m in model.modules():
        if type(m) is LlamaRMSNorm:
            m.__class__ = cls
    return cls


def _deepspeed_meta_fill(model, paths):
    """DeepSpeed's per-file checkpoint traversal (replace_module), with no layer replaced (tp=1)."""
    from deepspeed.module_inject.replace_module import replace_module

    for p in paths:
        replace_module(model, torch.nn.Identity, lambda child, *a, **k: child, None, checkpoint=str(p))


def test_unknown_norm_stays_on_meta_unless_registered(tiny, tmp_path):
    paths = files.checkpoint_files(tiny, "safetensors")
    plain = meta.build_on_meta(_ctx(tiny, tmp_path))
    _rename_norms(plain, "InternLM2RMSNorm")
    assert list(meta.unknown_norms(plain)) == ["InternLM2RMSNorm"]
    _deepspeed_meta_fill(plain, paths)
    assert plain.model.norm.weight.is_meta and not plain.lm_head.weight.is_meta

    fixed = meta.build_on_meta(_ctx(tiny, tmp_path))
    cls = _rename_norms(fixed, "InternLM2RMSNorm")
    undo = meta.register_load_modules(meta.unknown_norms(fixed).values())
    try:
        _deepspeed_meta_fill(fixed, paths)
    finally:
        undo()
    from deepspeed.module_inject.auto_tp import Loading

    assert not Loading.is_load_module(cls(4))  # the registration is gone again
    assert not any(p.is_meta for p in fixed.parameters())
    assert torch.equal(fixed.model.norm.weight, torch.ones_like(fixed.model.norm.weight))


def test_unfillable_parameters_fail_before_init_naming_each_and_why(tiny, tmp_path, monkeypatch):
    build = meta.build_on_meta

    def with_extras(ctx):
        model = build(ctx)
        with torch.device("meta"):
            model.model.scaler = torch.nn.Module()
            model.model.scaler.scale = torch.nn.Parameter(torch.empty(2, 2))
            model.model.extra_head = torch.nn.Linear(4, 4, bias=False)
        return model

    monkeypatch.setattr(meta, "build_on_meta", with_extras)
    with pytest.raises(RuntimeError) as err:
        meta.MetaLoader().load(_ctx(tiny, tmp_path, world_size=2), {})
    msg = str(err.value)
    assert "2 parameters on the meta device" in msg
    assert "model.scaler.scale: Module is not a module DeepSpeed's checkpoint loader fills" in msg
    assert "model.extra_head.weight: not in any checkpoint file" in msg


def test_tp1_deepspeed_ignores_checkpoint_so_meta_fills_itself(tiny, tmp_path, eager_model, monkeypatch):
    import deepspeed
    import safetensors.torch

    from dsexp.engines.init_inference.rank import InitInference

    opened = []
    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: (opened.append(a[0]), real(*a, **k))[1])
    desc = meta.ds_checkpoint(files.checkpoint_files(tiny, "safetensors"))
    bare = meta.build_on_meta(_ctx(tiny, tmp_path))
    engine = deepspeed.init_inference(bare, tensor_parallel={"tp_size": 1}, dtype=torch.bfloat16, checkpoint=desc)
    assert opened == [] and not next(engine.module.parameters()).is_meta  # to_empty: memory, never the files

    ctx = _ctx(tiny, tmp_path)
    loaded = meta.MetaLoader().load(ctx, {})
    assert loaded.checkpoint is None and loaded.info["filled_by"] == "dsexp"
    module, _ = InitInference().wrap(loaded.model, ctx, checkpoint=loaded.checkpoint)
    report = loaded.finalize(module)
    assert report["fill"]["tensors"] == len(list(eager_model.state_dict()))
    assert torch.equal(_logits(module), _logits(eager_model))


def test_fill_is_strict(tmp_path):
    from safetensors.torch import save_file

    module = torch.nn.Linear(3, 2)
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, str(path))
    assert files.fill(module, [path])["tensors"] == 2 and torch.equal(module.weight, torch.ones(2, 3))
    save_file({"weight": torch.ones(2, 3)}, str(path))
    with pytest.raises(RuntimeError, match=r"1 module tensors not in the files \(bias\)"):
        files.fill(module, [path])
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2), "extra": torch.zeros(1)}, str(path))
    with pytest.raises(RuntimeError, match=r"1 file tensors not in the module \(extra\)"):
        files.fill(module, [path])
    save_file({"weight": torch.ones(3, 3), "bias": torch.zeros(2)}, str(path))
    with pytest.raises(RuntimeError, match=r"weight: w.safetensors holds shape \(3, 3\)"):
        files.fill(module, [path])


def test_split_is_cached_by_key(tmp_path, monkeypatch, tiny):
    spec = _spec(["load=sharded", "tp=2", f"cache_dir={tmp_path}"])
    runs = []

    def fake_run(spec_, runtime, run_dir, role, what, extra, missing):
        out = Path(extra["split_out"])
        runs.append(out)
        for r in range(spec_.tp):
            (out / f"rank{r:03d}.json").write_text(json.dumps({"files": [], "bytes": 10 + r}))
        assert role == "split" and not any(missing(r) for r in range(spec_.tp))

    monkeypatch.setattr(split_mod, "run_role", fake_run)
    runtime = {"model_dir": str(tiny), "device": "cpu"}
    first = split_mod.ensure_split(spec, runtime, tmp_path / "job")
    again = split_mod.ensure_split(spec, runtime, tmp_path / "job")
    assert (first["cache_hit"], again["cache_hit"], len(runs)) == (False, True, 1)
    assert again["rank_bytes"] == [10, 11] and again["dir"] == first["dir"]
    assert str(tmp_path / "shards") in first["dir"]
    other = [
        _spec(["load=sharded", *o])
        for o in (["tp=4"], ["tp=2", "dtype=fp32"], ["tp=2", "engine.keep_module_on_host=true"])
    ]
    keys = {split_mod.split_key(s, tiny) for s in [spec, *other]}
    assert len(keys) == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["load=sharded", "engine.kernel_inject=true"], "load=sharded slices with AutoTP"),
        (["load=meta", "engine.kernel_inject=true"], "reads files with torch.load only"),
        (["load=sharded", "engine.name=zero_inference"], "load=sharded needs engine=init_inference"),
        (["load=meta", "engine.name=hf_tp"], "load=meta needs engine=init_inference"),
    ],
)
def test_validation_refuses_combinations_that_cannot_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_spec(overrides), gpus=1)


def test_conversion_is_recorded_where_it_happens(tmp_path, monkeypatch):
    from dsexp.job import run, split

    spec = _spec(["model.dtype=fp32", "dtype=bf16"])
    assert run.prepare_load(spec, {}, tmp_path)["conversion"] == "fp32->bf16"
    assert (
        run.prepare_load(_spec(["model.dtype=fp32", "dtype=bf16", "load=meta"]), {}, tmp_path)["conversion"]
        == "fp32->bf16"
    )
    monkeypatch.setattr(split, "ensure_split", lambda spec, runtime, job_dir: {"conversion": "fp32->bf16"})
    sharded = run.prepare_load(_spec(["model.dtype=fp32", "dtype=bf16", "load=sharded", "tp=2"]), {}, tmp_path)
    assert sharded["conversion"] is None and sharded["split"]["conversion"] == "fp32->bf16"  # done once, by the split
    assert run.prepare_load(_spec(), {}, tmp_path)["conversion"] is None


@pytest.mark.gpu
def test_buffer_check_leaves_nothing_in_the_gpu_allocator(tiny, tmp_path):
    """The after-engine buffer check compares on the host: on the GPU its temporaries stayed reserved (16-20 MiB at
    20B shapes on the H200), and every NVML figure charged them to the engine."""
    originals = buffers.snapshot(meta.build_on_meta(_ctx(tiny, tmp_path)))
    model = from_pretrained(_ctx(tiny, tmp_path)).eval().to("cuda")

    def on_device_untouched(check):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        out = check()
        assert (torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()) == before
        return out

    assert on_device_untouched(lambda: buffers.differences(model, originals)) == ({}, [])  # value by value
    for buf in buffers.non_persistent_buffers(model).values():
        buf.data = buf.data.bfloat16()  # what init_inference(dtype=bf16) does to them
    states, gone = on_device_untouched(lambda: buffers.differences(model, originals))
    assert states and not gone and set(states.values()) == {"cast"}
    nonfinite = on_device_untouched(lambda: buffers.nonfinite(buffers.non_persistent_buffers(model), on_host=True))
    assert nonfinite == []


@pytest.mark.slow  # 60-120 s: a tp=2 job and its tp=1 reference
def test_meta_load_of_a_checkpoint_in_several_files_shares_out_the_head_counts(tmp_path):
    """DeepSpeed loads an AutoTP checkpoint file by file and marks a module done the first time it meets it: a
    module whose weights come in a later file kept num_heads whole, and InternLM2's generate failed ("attention
    weights should be of size (b, 48, ...)") on the H200 at 20B shapes (10 files). dsexp shares the counts out
    once every file is in: the run is ok, correct against tp=1, and says which modules it mended."""
    import json

    from helpers.run import run_dsexp

    run_dsexp(
        [
            "experiment=autotp",
            "model=internlm2_tiny",
            "tp=2",
            "load=meta",
            "engine.injection_policy=infer",
            "model.shard_mb=0.05",
            "generate.prompt_tokens=32",
            "generate.new_tokens=4",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
        cache=tmp_path / "cache",
    )
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "ok" and result["correctness"]["passed"]
    assert result["engine"]["autotp_attributes_resharded"]["modules"] > 0
