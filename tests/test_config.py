"""Config composition and validation: every bad setting is refused with a message naming the key."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from dsexp.compose.config import to_schema
from dsexp.core.schema import BudgetConfig, ConfigError, QuantConfig

from helpers.run import CONF, ROOT, compose, spec_of


def test_default_composes_to_cpu_tiny_eager():
    spec = spec_of()
    assert (spec.model.name, spec.load.name, spec.engine.name, spec.tp, spec.device) == (
        "tiny",
        "eager",
        "init_inference",
        1,
        "cpu",
    )
    assert spec.dtype == spec.model.dtype == "bf16"


@pytest.mark.parametrize("group", ["model", "load", "engine", "zero", "launcher"])
def test_every_group_option_composes(group):
    for path in sorted((CONF / group).glob("*.yaml")):
        over = [f"{group}={path.stem}"] + (["model.path=/nonexistent"] if path.stem == "local" else [])
        spec = to_schema(compose(over))
        assert getattr(spec, group).name == path.stem


@pytest.mark.parametrize("preset", [p.stem for p in sorted((CONF / "experiment").glob("*.yaml"))])
def test_experiment_presets_compose(preset):
    cfg = compose([f"experiment={preset}"], hydra=True)
    assert to_schema(cfg).model.name


def test_experiment_presets_span_several_groups():
    """experiment/ keeps presets over several groups; one that only picks a model is a model preset (conf/model/)."""
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        node = yaml.safe_load(path.read_text())
        groups = {
            next(iter(d)).split("/")[-1]
            for d in node.get("defaults") or []
            if isinstance(d, dict) and next(iter(d)).startswith("override /")
        }
        inherits = [d for d in node.get("defaults") or [] if isinstance(d, str) and d != "_self_"]
        keys = set(node) - {"defaults", "variant", "model"}
        assert inherits or groups - {"model"} or keys, f"{path.name} only picks a model: move it to conf/model/"


@pytest.mark.parametrize("preset", [p.stem for p in sorted((CONF / "model").glob("tiny_*.yaml"))])
def test_tiny_architecture_presets_are_model_presets_that_validate(preset):
    """model=tiny_<arch>: model=config at tiny shapes; transformers builds its config, and tp=2 splits its heads."""
    spec = spec_of(f"model={preset}", "tp=2")
    assert (spec.model.name, spec.variant, spec.model.path) == (preset, None, None)
    from dsexp.models.presets import make_config

    built = make_config(spec.model.arch, spec.model.dims, spec.model.dtype)
    assert (built.model_type, built.hidden_size, built.num_hidden_layers) == (spec.model.arch, 128, 2)


def test_debug_fast_is_a_quick_functional_run():
    spec = spec_of("debug=fast")
    assert (spec.probe.sample_ms, spec.check.correctness, spec.generate.new_tokens) == (0, False, 2)
    assert spec_of().probe.sample_ms == 20 and spec_of().check.correctness  # the default measures


def test_fault_is_off_by_default_and_set_with_the_debug_option():
    assert to_schema(compose()).fault is None
    spec = spec_of("debug=fault", "fault={rank: 1, phase: load, kind: raise, once: true}")
    assert spec.fault == {"rank": 1, "phase": "load", "kind": "raise", "once": True}
    assert spec_of("debug=fault").fault is None  # the option adds the key; the fault itself is given with it


def test_conf_comments_name_files_that_exist():
    """A config file that points a reader to other config files (e.g. model/config.yaml to the tiny presets)."""
    for path in sorted(CONF.rglob("*.yaml")):
        for named in re.findall(r"conf/[\w/]*[\w*]+\.yaml", path.read_text()):
            assert list(ROOT.glob(named)), f"{path.relative_to(ROOT)} names {named}, which matches no file"


def test_tp_is_a_plain_int():
    tp = spec_of("tp=2").tp
    assert type(tp) is int and tp == 2  # not OmegaConf's node or a string: the ranks' count, as launch uses it


@pytest.mark.parametrize(
    "overrides,gpus,needle",
    [
        (["tp=0"], 0, "tp=0"),
        (["tp=4"], 2, "tp=4 needs 4 GPUs"),
        (["tp=8"], 0, "tp=8 leaves some ranks with no attention heads"),  # tiny has 4 KV heads
        (["engine.kernel_inject=true"], 0, "engine.kernel_inject"),
        (["dtype=fp16"], 0, "dtype=fp16"),
        (["dtype=int8"], 0, "dtype=int8: the run dtype is fp32, bf16 or fp16"),  # and which quant members instead
        (["device=cuda"], 0, "device=cuda"),
        (["load.format=gguf"], 0, "load.format"),
        (["probe.sample_ms=50"], 0, "probe.sample_ms"),
        (["probe.sample_ms=-1"], 0, "or 0 to turn the background sampler off"),
        (["probe.memory_snapshot=true"], 0, "probe.memory_snapshot=true on device=cpu"),
        (["probe.memory_snapshot=true", "device=cpu"], 2, "probe.memory_snapshot=true on device=cpu"),
        (["probe.memory_snapshot=true", "probe.snapshot_max_mb=0"], 1, "probe.snapshot_max_mb=0"),
        (["model=local", "model.path=/does/not/exist"], 0, "model.path='/does/not/exist' does not exist"),
    ],
)
def test_bad_settings_name_the_key(overrides, gpus, needle):
    with pytest.raises(ConfigError, match=None) as e:
        spec_of(*overrides, gpus=gpus)
    assert needle in str(e.value)


def test_sampler_period_zero_is_accepted_as_off_where_a_period_past_20_ms_is_refused():
    spec_of("probe.sample_ms=0", gpus=0)  # no error: 0 runs no sampler thread (the phase-end readings only)
    with pytest.raises(ConfigError, match=r"probe.sample_ms=25.0: the sampler period must be in \(0, 20\] ms"):
        spec_of("probe.sample_ms=25", gpus=0)


def test_memory_snapshot_is_off_by_default_and_accepted_on_a_gpu():
    assert spec_of(gpus=0).probe.memory_snapshot is False
    spec = spec_of("probe.memory_snapshot=true", gpus=1)
    assert spec.device == "cuda" and spec.probe.memory_snapshot


def test_wrong_type_names_the_key():
    """Refused as the config is composed (the schema is Hydra's `dsexp_schema`), the key and the type named."""
    from dsexp.compose.config import config_error

    with pytest.raises(Exception) as e:
        compose(["tp=two"])
    assert config_error(e.value).startswith("config key 'tp': Value 'two'") and "Integer" in config_error(e.value)


def test_every_default_is_the_schemas_and_conf_sets_only_what_differs():
    """Defaults are written once, in core/schema.py: no YAML file of a group repeats a value its schema class
    gives (a preset that builds on another may restore one its parent changed)."""
    import dataclasses

    from dsexp.core import schema

    classes = {"load": schema.LoadConfig, "engine": schema.EngineConfig, "zero": schema.ZeroConfig,
               "launcher": schema.LauncherConfig, "trim": schema.TrimConfig, "stack": schema.StackConfig,
               "model": schema.ModelConfig, "tracking": schema.TrackingConfig}  # fmt: skip
    repeated = []
    for group, cls in classes.items():
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        for path in sorted((CONF / group).glob("*.yaml")):
            node = yaml.safe_load(path.read_text()) or {}
            if any(d != "_self_" for d in node.get("defaults") or []):
                continue  # builds on another preset
            repeated += [f"{path.name}: {k}" for k, v in node.items() if k != "name" and defaults.get(k, object()) == v]
    top = yaml.safe_load((CONF / "config.yaml").read_text())
    assert not repeated and set(top) == {"defaults", "dtype", "cache_dir"}, repeated
    assert to_schema(compose()) == to_schema(compose(["tp=1", "timeout_s=900", "probe.sample_ms=20"]))


def test_tracking_none_keeps_results_on_disk_and_a_later_sync_logs_them_to_the_default_store(tmp_path, monkeypatch):
    from dsexp.tracking import relog
    from dsexp.tracking.runs import OFF, resolve_uri, track_job

    assert to_schema(compose(["tracking=none"])).tracking.uri == OFF
    assert to_schema(compose(["tracking=mlflow"])).tracking == to_schema(compose()).tracking
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = {"config": {"tracking": {"uri": OFF, "experiment": "dsexp"}}, "status": "ok"}
    (tmp_path / "0").mkdir()
    track_job(result, tmp_path / "0", None, resolve_uri(OFF), "dsexp")
    assert result["tracking"] == {"uri": OFF} and not list(tmp_path.glob("mlflow*"))
    assert json.loads((tmp_path / "0" / "result.json").read_text())["tracking"] == {"uri": OFF}
    uri, _ = relog._target(tmp_path, [(tmp_path / "0", result)], None, None)
    assert uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"


def test_local_folder_checks(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        spec_of("model=local", f"model.path={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ConfigError, match=f"holds no weights.*use model=config model.config_path={tmp_path}"):
        spec_of("model=local", f"model.path={tmp_path}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="trust_remote_code=true explicitly"):
        spec_of("model=local", f"model.path={tmp_path}")
    with pytest.raises(ConfigError, match="model.safetensors is truncated or empty"):
        spec_of("model=local", f"model.path={tmp_path}", "model.trust_remote_code=true")
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert spec_of("model=local", f"model.path={tmp_path}", "model.trust_remote_code=true").model.path == str(tmp_path)


def test_every_group_option_composes_as_it_did_when_its_yaml_held_every_default():
    """tests/data/composed_before.json: every group option's config as composed at commit d6ff779, when conf/ still
    wrote every default out (cache_dir, the machine's, aside). Defaults now live in the schema alone; a preset that
    builds on another keeps what it changes (small keeps 100 MB shards over tiny's 2)."""
    import dataclasses

    before = json.loads((ROOT / "tests" / "data" / "composed_before.json").read_text())
    for case, expected in before.items():
        overrides = case.split()
        got = dataclasses.asdict(to_schema(compose(overrides)))
        got.pop("cache_dir")
        for (group, key), default in KEYS_ADDED_SINCE.items():
            assert got[group].pop(key) == default, (case, key)
        assert got.pop("budget") == dataclasses.asdict(BudgetConfig()), case  # the group added since: no budget
        assert got.pop("quant") == dataclasses.asdict(QuantConfig()), case  # and no quantization
        assert json.loads(json.dumps(got)) == expected, case


# keys the schema gained after the snapshot, with their defaults (a grid of one point at batch 1: the job as before)
KEYS_ADDED_SINCE = {
    ("generate", "batch_size"): 1,
    ("generate", "prompt_tokens"): None,
    ("generate", "repeats"): 1,
    ("generate", "warmup"): 1,
    ("generate", "bisect_from"): None,
    ("trim", "last_logits"): False,
}


def test_the_benchmark_composes_what_a_job_runs():
    """`make bench`'s benchmarks read the sampler's period from the composed config (benchmarks/common.py; it once
    composed without dsexp's schema registered, and Hydra could not find `dsexp_schema`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    composed = bench.compose("tiny")
    assert composed["probe"]["sample_ms"] == spec_of().probe.sample_ms and composed["model"]["name"] == "tiny"
