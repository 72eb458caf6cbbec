"""Software stacks: the ranks on pinned package versions, prepared once from a wheelhouse or an index; bad pins
refused before anything is launched; a stack that does not import recorded as stack_error."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from dsexp.compose.config import to_schema
from dsexp.core.schema import STACK_PACKAGES, STACK_PRESETS, StackConfig, stack_label, stack_pins
from dsexp.job import overlay

from helpers.run import CONF, compose, run_dsexp, sweep_results

ACCELERATE = "1.13.0"  # any release other than the job environment's, small and pure Python


def test_pins_and_labels():
    seed = to_schema(compose(["stack=seed"])).stack
    assert stack_pins(seed)["transformers"] == "transformers==4.42.4"
    assert stack_pins(seed)["huggingface-hub"] == "huggingface-hub==0.24.7"  # distribution names
    assert stack_label(seed) == "seed"
    assert stack_label(to_schema(compose(["stack=seed", "stack.deepspeed=0.15.0"])).stack) == "seed+deepspeed=0.15.0"
    assert stack_label(to_schema(compose(["stack.transformers=4.46.3"])).stack) == "current+transformers=4.46.3"
    assert stack_pins(to_schema(compose()).stack) == {} and stack_label(StackConfig()) == "current"
    assert stack_pins({"numpy": "<2"}) == {"numpy": "numpy<2"}


@pytest.mark.parametrize("preset", sorted(STACK_PRESETS))
def test_stack_presets_match_their_labels(preset):
    """The label names only what differs from the preset, so the table in core.schema must be the YAML's pins."""
    node = yaml.safe_load((CONF / "stack" / f"{preset}.yaml").read_text())
    pinned = {k: str(node[k]) for k in STACK_PACKAGES if node.get(k) is not None}
    assert pinned == STACK_PRESETS[preset]


@pytest.mark.parametrize("trim", ["shard_head", "shard_embedding"])
def test_trims_deepspeed_014_cannot_do_are_refused_on_the_seed_stack(trim):
    from dsexp.compose.validate import validate
    from dsexp.core.schema import ConfigError

    with pytest.raises(ConfigError, match=f"trim.{trim}=true with stack.deepspeed=0.14.4"):
        validate(to_schema(compose(["experiment=autotp", "stack=seed", "tp=2", f"trim.{trim}=true"])), gpus=0)
    assert validate(to_schema(compose(["experiment=autotp", "stack=seed", "tp=2", "trim.dedupe_buffers=true"])), 0)


def test_deepspeed_is_built_into_a_wheel_only_when_none_is_at_hand(tmp_path):
    """DeepSpeed ships source archives whose build imports torch: dsexp builds the wheel itself (never in pip's
    isolated build environment), unless a folder pip looks in already has it."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    sources = ["--find-links", str(folder)]
    assert not overlay._have_wheel(sources, "deepspeed", "0.14.4")  # an empty folder has none
    (folder / "deepspeed-0.14.4-py3-none-any.whl").write_bytes(b"")
    assert overlay._have_wheel(sources, "deepspeed", "0.14.4") and not overlay._have_wheel(sources, "deepspeed", "0.15")


def test_the_key_covers_pins_python_platform_and_torch(monkeypatch):
    a = overlay.stack_key(StackConfig(transformers="4.46.3"))
    assert a != overlay.stack_key(StackConfig(transformers="4.47.1"))
    assert a == overlay.stack_key(StackConfig(name="other", transformers="4.46.3", wheelhouse="/x"))  # same software
    monkeypatch.setattr(overlay, "base_torch", lambda: "9.9.9")
    assert a != overlay.stack_key(StackConfig(transformers="4.46.3"))


def test_a_bad_pin_is_refused_before_any_job(tmp_path, cache_dir):
    empty = tmp_path / "wheels"
    empty.mkdir()
    proc = run_dsexp(
        ["-m", "tp=1", "stack.transformers=9.9.9", f"stack.wheelhouse={empty}", "hydra.sweep.dir=multirun/bad"],
        tmp_path,
        cache_dir,
        check=False,
    )
    assert proc.returncode == 2
    assert "the sweep was not started" in proc.stderr and "transformers==9.9.9" in proc.stderr
    assert not list((tmp_path / "multirun" / "bad").glob("*/result.json"))
    single = run_dsexp(
        ["tp=1", "stack.transformers=9.9.9", f"stack.wheelhouse={empty}"], tmp_path, cache_dir, check=False
    )
    assert single.returncode != 0 and "bad stack" in single.stderr and "transformers==9.9.9" in single.stderr


def test_a_stack_needing_another_torch_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    overlay._stub_wheel(wheels, "torch", "1.0.0")
    fake = StackConfig(deepspeed=None, wheelhouse=str(wheels))
    with pytest.raises(overlay.StackError, match="conflicting dependencies|needs another torch"):
        overlay.plan(["torch==1.0.0"], overlay._sources(fake, tmp_path / "built"))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """A folder holding one wheel, filled from the package index the way `python -m dsexp.stacks fill` does."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    wheels = overlay.fill(StackConfig(accelerate=ACCELERATE), folder)
    assert any(w.startswith(f"accelerate-{ACCELERATE}-") for w in wheels)
    assert not any(w.startswith("torch-") for w in wheels)  # torch is never part of a stack
    return folder


@pytest.mark.slow  # minutes on 2 cores: make test-all
def test_a_stack_from_a_wheelhouse_runs_the_ranks_on_its_pins(tmp_path, cache_dir, wheelhouse):
    """No index at all (--no-index): the overlay is built from the folder, and the ranks import its version."""
    args = [
        "-m",
        "tp=1,2",
        "model=tiny",
        f"stack.accelerate={ACCELERATE}",
        f"stack.wheelhouse={wheelhouse}",
        "hydra.sweep.dir=multirun/s",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    proc = run_dsexp(args, tmp_path, cache_dir)
    assert f"stack current+accelerate={ACCELERATE} prepared" in proc.stdout
    results = sweep_results(tmp_path / "multirun" / "s")
    assert [r["status"] for r in results] == ["ok", "ok"]
    for res in results:
        assert res["runtime"]["stack"]["packages"] == [f"accelerate=={ACCELERATE}"]
        assert all(rk["software"]["versions"]["accelerate"] == ACCELERATE for rk in res["ranks"])
        assert res["correctness"]["passed"]
    again = run_dsexp(args, tmp_path, cache_dir)  # cached: nothing prepared, nothing run again
    assert "prepared" not in again.stdout
    info = overlay.prepare_stack(
        StackConfig(accelerate=ACCELERATE, wheelhouse=str(wheelhouse)), str(tmp_path / "cache")
    )
    assert info["cache_hit"] is True and info["prepare_s"] < 0.5
    assert Path(info["extensions_dir"]).parent == Path(info["site"]).parent  # its own extension build folder


@pytest.mark.slow  # minutes on 2 cores: make test-all
def test_a_stack_that_does_not_import_is_a_recorded_stack_error(tmp_path, cache_dir, wheelhouse):
    """transformers refuses an accelerate it does not support?  Use one that cannot import at all: a broken wheel."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for w in wheelhouse.glob("*.whl"):
        (broken / w.name).write_bytes(w.read_bytes())
    _broken_wheel(broken, "safetensors", "0.8.99")
    args = [
        "-m",
        "tp=1",
        "model=tiny",
        "stack.safetensors=0.8.99,null",
        f"stack.wheelhouse={broken}",
        "hydra.sweep.dir=multirun/e",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    run_dsexp(args, tmp_path, cache_dir)
    first, second = sweep_results(tmp_path / "multirun" / "e")
    assert first["status"] == "failed" and first["failure"]["cause"] == "stack_error"
    assert (
        "current+safetensors=0.8.99" in first["failure"]["message"]
        and "broken on purpose" in first["failure"]["message"]
    )
    assert second["status"] == "ok"  # the sweep went on


def _broken_wheel(folder: Path, name: str, ver: str) -> None:
    """A wheel whose package raises at import (a stack that cannot run)."""
    import zipfile

    dist = f"{name}-{ver}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{ver}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "raise ImportError('broken on purpose')\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


@pytest.mark.network  # numpy's cp312 wheel, from the package index
def test_fill_for_another_python_keeps_torch_out(tmp_path):
    """A wheelhouse for the GPU machine's cp312, from here: the pins' wheels for that Python, no torch."""
    wheels = overlay.fill(StackConfig(numpy="1.26.4"), tmp_path, python_version="3.12", torch="2.11.0")
    assert any(w.startswith("numpy-1.26.4-cp312") for w in wheels) and not any(w.startswith("torch") for w in wheels)


def test_fill_job_downloads_the_job_wheels_for_the_gpu_machine_and_builds_the_rest(tmp_path, monkeypatch):
    """`python -m dsexp.stacks fill-job DIR --python-version 3.12`: the pip commands it runs (recorded, no network):
    binary wheels for the target's CPython without dependencies, the source-only ones built here, DeepSpeed built
    without ops and outside pip's isolated build (its setup imports torch); DeepSpeed is not built twice."""
    calls = []

    def pip(args, what, env=None):
        calls.append((list(args), dict(env or {})))
        if args[0] == "download" and "--no-binary" in args:  # the DeepSpeed sdist _build_deepspeed_wheel builds
            dest = Path(args[args.index("--dest") + 1])
            (dest / "deepspeed-0.19.8.tar.gz").write_bytes(b"")
        if args[0] == "wheel" and any(a.endswith("deepspeed-0.19.8.tar.gz") for a in args):
            wheel_dir = Path(args[args.index("--wheel-dir") + 1])
            (wheel_dir / "deepspeed-0.19.8-py3-none-any.whl").write_bytes(b"")

    monkeypatch.setattr(overlay, "_pip", pip)
    wheels = overlay.fill_job(tmp_path, python_version="3.12")
    assert wheels == ["deepspeed-0.19.8-py3-none-any.whl"]  # what the recorded pip left in the folder
    (download, _), (source, _), (ds_sdist, _), (ds_wheel, ds_env) = calls
    assert download[:4] == ["download", "--quiet", "--no-deps", "--only-binary=:all:"]
    assert download[download.index("--dest") + 1] == str(tmp_path)
    target = download[download.index("--python-version") :]
    assert target[:6] == ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    assert "manylinux_2_17_x86_64" in target and set(overlay.JOB_WHEELS) <= set(target)
    assert source[:3] == ["wheel", "--quiet", "--no-deps"] and source[-1] == "antlr4-python3-runtime==4.9.3"
    assert source[source.index("--wheel-dir") + 1] == str(tmp_path)
    assert "--no-binary" in ds_sdist and ds_sdist[-1] == "deepspeed==0.19.8"
    assert "--no-build-isolation" in ds_wheel and ds_env["DS_BUILD_OPS"] == "0"
    assert ds_wheel[ds_wheel.index("--wheel-dir") + 1] == str(tmp_path)
    calls.clear()
    overlay.fill_job(tmp_path, python_version="3.12")  # the wheel is there now: only the downloads run again
    assert [c[0][0] for c in calls] == ["download", "wheel"] and "--no-binary" not in calls[0][0]


def test_fill_job_list_is_what_the_gpu_image_lacks_at_versions_dsexp_accepts():
    """The pins agree with pyproject's requirements (mlflow-skinny is MLflow's client) and the Makefile's DeepSpeed,
    include every job-side package the image lacks, and never the image's own torch, transformers or numpy (a
    wheel of those would replace its CUDA build)."""
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {Requirement(r).name: Requirement(r).specifier for r in project}
    pins = {Requirement(p).name: str(Requirement(p).specifier).lstrip("=") for p in overlay.JOB_WHEELS}
    pins.update({Requirement(p).name: str(Requirement(p).specifier).lstrip("=") for p in overlay.JOB_SOURCE_ONLY})
    pins["deepspeed"] = overlay.JOB_DEEPSPEED.split("==")[1]
    assert {"deepspeed", "hydra-core", "omegaconf", "mlflow-skinny", "pydantic", "antlr4-python3-runtime"} <= set(pins)
    assert not {"torch", "transformers", "numpy", "pandas", "matplotlib", "psutil", "nvidia-ml-py"} & set(pins)
    for name, version in [(n, v) for n, v in pins.items() if n in wanted] + [("mlflow", pins["mlflow-skinny"])]:
        assert version in wanted[name], (name, version, str(wanted[name]))
    assert f"deepspeed=={pins['deepspeed']}" in (root / "Makefile").read_text()


@pytest.mark.slow
def test_the_seed_stack_next_to_todays(tmp_path, cache_dir):
    """The must-show sweep: on stack=seed the verbatim seed call runs and shards nothing, on current DeepSpeed 0.19.8
    rejects it; AutoTP is correct on both."""
    run_dsexp(
        [
            "-m",
            "stack=seed,current",
            "experiment=seed_issue,autotp",
            "model=internlm2_tiny",
            "tp=1,2",
            "hydra.sweep.dir=multirun/seed",
        ],
        tmp_path,
        cache_dir,
        timeout=1800,
    )
    results = {
        (r["config"]["stack"]["name"], r["config"]["variant"], r["config"]["tp"]): r
        for r in sweep_results(tmp_path / "multirun" / "seed")
    }
    for tp in (1, 2):
        seed = results[("seed", "seed_issue", tp)]
        assert seed["status"] == "ok" and seed["software"]["versions"]["deepspeed"] == "0.14.4"
        assert seed["software"]["versions"]["transformers"] == "4.42.4"
        assert seed["engine"]["modules"] == {"removed": {}, "added": {}}  # kernel injection replaced nothing
        assert seed["engine"]["weight_fraction"] == pytest.approx(1.0)
        assert results[("current", "seed_issue", tp)]["failure"]["cause"] == "config_rejected"
        for stack in ("seed", "current"):
            assert results[(stack, "autotp", tp)]["correctness"]["passed"]
    assert results[("seed", "autotp", 2)]["engine"]["weight_fraction"] < 0.8
    json.dumps(results[("seed", "autotp", 2)]["runtime"]["stack"])  # recorded, serialisable


@pytest.mark.network  # its wheelhouse is filled from the package index
def test_dsexp_stacks_command_prints_the_prepared_stack(tmp_path, wheelhouse):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsexp.stacks",
            "prepare",
            f"stack.accelerate={ACCELERATE}",
            f"stack.wheelhouse={wheelhouse}",
            f"cache_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(proc.stdout)["packages"] == [f"accelerate=={ACCELERATE}"]
