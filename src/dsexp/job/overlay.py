"""Software stacks: the ranks on other versions of transformers, DeepSpeed, ... than the job's own environment.

A stack with pins (`stack=seed`, `stack.transformers=4.46.3`) is an overlay: a folder holding exactly the pinned
packages and what they need beyond the job environment, put first on the ranks' PYTHONPATH. The ranks run with
the job's own Python, so torch (the GPU machine's CUDA build included) and every package the stack does not
replace come from the job environment; nothing is ever installed into it, and torch never into a stack.

Preparing one, once per key (pins, Python, platform, the job's torch), under `<cache_dir>/stacks/`:
1. pip resolves the pins against the job environment as it is (`pip install --dry-run --report`, torch
   constrained to the installed version): the report lists only what the environment lacks. A stack that would
   need another torch, a pin that does not exist or pins that conflict fail here, with pip's message.
2. `pip install --no-deps --target <stack>/site` of exactly that list.
DeepSpeed is published as a source archive whose build imports torch: it is first built here into a wheel
(`DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation`, pure Python; ops are JIT-built on use, into the
stack's own TORCH_EXTENSIONS_DIR). Offline machines install from `stack.wheelhouse` only; `fill` (below) fills
one on a machine that reaches a package index, for this Python or another (a GPU box's cp312).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from dsexp.core.compat import installed
from dsexp.core.fs import build_once
from dsexp.core.schema import STACK_PACKAGES, StackConfig, stack_label, stack_pins

STACK_FORMAT = 1
DONE_MARK = ".dsexp-stack-complete.json"


class StackError(RuntimeError):
    """A stack that cannot be prepared (a pin that does not exist, pins that conflict, another torch needed)."""


def base_torch() -> str:
    return version("torch")


def stack_key(stack: StackConfig) -> str:
    blob = json.dumps(
        {
            "pins": sorted(stack_pins(stack).values()),
            "python": platform.python_version_tuple()[:2],
            "platform": [sys.platform, platform.machine()],
            "torch": base_torch(),
            "v": STACK_FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def stack_dir(stack: StackConfig, cache_dir: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.+-]", "_", stack_label(stack))
    return Path(cache_dir).expanduser() / "stacks" / f"{safe}-{stack_key(stack)}"


def prepare_stack(stack: StackConfig, cache_dir: str) -> Dict[str, Any]:
    """The stack's runtime facts for the ranks, preparing its overlay first if no complete copy is cached."""
    folder = stack_dir(stack, cache_dir)
    info: Dict[str, Any] = {
        "label": stack_label(stack),
        "key": stack_key(stack),
        "pins": sorted(stack_pins(stack).values()),
        "modules": [pkg for pkg in STACK_PACKAGES if getattr(stack, pkg) not in (None, "")],  # imported at start
        "extensions_dir": str(folder / "torch_extensions"),
        "site": None,
        "cache_hit": None,
    }
    if not info["pins"]:
        return info
    t0 = time.perf_counter()
    done, hit = build_once(folder, DONE_MARK, lambda tmp: _build(stack, tmp))
    return {**info, "site": str(folder / "site"), "cache_hit": hit, "prepare_s": time.perf_counter() - t0, **done}


def rank_env(stack_info: Optional[Dict[str, Any]]) -> Dict[str, str]:
    """What the ranks' environment needs for this stack: the overlay first on PYTHONPATH, its own extension folder."""
    if not stack_info:
        return {}
    env = {"TORCH_EXTENSIONS_DIR": stack_info["extensions_dir"]}
    if stack_info.get("site"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (stack_info["site"], os.environ.get("PYTHONPATH")) if p)
        env["PYTHONNOUSERSITE"] = "1"
    return env


def other_transformers(stack: StackConfig) -> Optional[str]:
    """The transformers the stack pins where it is not this environment's; None otherwise."""
    pinned = stack.transformers
    return pinned if pinned and pinned != installed("transformers") else None


def run_in_stack(stack: StackConfig, cache_dir: str, module: str, *args: str, stdin: Optional[str] = None):
    """`python -m module args` with the stack's overlay first on the path, as its ranks run (the overlay prepared
    first if it is not cached): a CompletedProcess with its output captured; StackError where the stack cannot be
    prepared."""
    env = {**os.environ, **rank_env(prepare_stack(stack, cache_dir))}
    argv = [sys.executable, "-m", module, *args]
    return subprocess.run(argv, env=env, input=stdin, capture_output=True, text=True)


def failed_tail(proc: subprocess.CompletedProcess, lines: int = 3) -> str:
    """The last lines a failed subprocess wrote (stderr, else stdout), joined on one line."""
    return " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-lines:])


# --- building ---------------------------------------------------------------------------------------


def _build(stack: StackConfig, tmp: Path) -> Dict[str, Any]:
    tmp.mkdir(parents=True)
    pins = list(stack_pins(stack).values())
    sources = _sources(stack, tmp / "built")
    t0 = time.perf_counter()
    _build_deepspeed_wheel(pins, sources, tmp / "built")
    t1 = time.perf_counter()
    packages = plan(pins, sources)
    t2 = time.perf_counter()
    _pip(
        ["install", "--quiet", "--no-deps", "--no-compile", "--target", str(tmp / "site"), *sources, *packages],
        what=f"installing stack {stack_label(stack)}",
    )
    shutil.rmtree(tmp / "built", ignore_errors=True)
    size = sum(p.stat().st_size for p in (tmp / "site").rglob("*") if p.is_file())
    return {
        "packages": packages,
        "build_s": t1 - t0,
        "plan_s": t2 - t1,
        "install_s": time.perf_counter() - t2,
        "bytes": size,
    }


def _sources(stack: StackConfig, built: Path) -> List[str]:
    """pip's package sources: the wheelhouse alone (offline), else the index; plus wheels built here."""
    built.mkdir(parents=True, exist_ok=True)
    if stack.wheelhouse:
        folder = Path(stack.wheelhouse).expanduser()
        if not folder.is_dir():
            raise StackError(f"stack.wheelhouse={stack.wheelhouse!r} is not a folder")
        return ["--no-index", "--find-links", str(folder.resolve()), "--find-links", str(built)]
    return ["--find-links", str(built), "--prefer-binary"]


def plan(pins: Sequence[str], sources: Sequence[str]) -> List[str]:
    """name==version of every package the job environment lacks for these pins (torch held at its version)."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={base_torch()}\n")
        report = Path(tmp) / "plan.json"
        _pip(
            [
                "install",
                "--dry-run",
                "--quiet",
                "--no-build-isolation",
                "--report",
                str(report),
                "--constraint",
                str(constraints),
                *sources,
                *pins,
            ],
            what=f"resolving {' '.join(pins)}",
        )
        items = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    if any(_canon(name) == "torch" for name, _ in items):
        raise StackError(
            f"{' '.join(pins)} needs another torch than the job environment's {base_torch()}; "
            "a stack never replaces torch"
        )
    return [f"{name}=={ver}" for name, ver in items]


def _build_deepspeed_wheel(pins: Sequence[str], sources: Sequence[str], built: Path) -> None:
    """DeepSpeed ships source archives only: build the pinned one into a pure-Python wheel (ops JIT-built later)."""
    wanted = next((re.sub(r"^deepspeed==", "", p) for p in pins if re.fullmatch(r"deepspeed==[\w.+]+", p)), None)
    if wanted is None or _have_wheel(sources, "deepspeed", wanted):
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DS_BUILD_OPS": "0", "TORCH_EXTENSIONS_DIR": str(Path(tmp) / "ext")}
        _pip(  # pip reads the sdist's metadata by running its setup.py, which imports torch: no build isolation
            [
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "--dest",
                tmp,
                *[s for s in sources if s != "--prefer-binary"],
                f"deepspeed=={wanted}",
            ],
            what=f"downloading deepspeed=={wanted}",
            env=env,
        )
        sdist = next(p for p in Path(tmp).iterdir() if p.name.startswith("deepspeed"))
        _pip(
            ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(built), str(sdist)],
            what=f"building deepspeed=={wanted} into a wheel",
            env=env,
        )


def _have_wheel(sources: Sequence[str], name: str, ver: str) -> bool:
    folders = [Path(sources[i + 1]) for i, s in enumerate(sources) if s == "--find-links"]
    return any(any(folder.glob(f"{name}-{ver}-*.whl")) for folder in folders if folder.is_dir())


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(args: List[str], what: str, env: Optional[Dict[str, str]] = None) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("ERROR")]
        detail = "\n  ".join(errors[-6:]) or (proc.stderr or proc.stdout).strip()[-2000:]
        raise StackError(f"{what} failed:\n  {detail}")


# --- filling a wheelhouse on a machine with a package index ---------------------------------------------------


def fill(
    stack: StackConfig,
    folder: Path,
    python_version: Optional[str] = None,
    torch: Optional[str] = None,
    platforms: Sequence[str] = (),
) -> List[str]:
    """Download every wheel the stack needs but torch into `folder` (built deepspeed wheel included), for this
    Python or another one (python_version "3.12", platforms such as manylinux_2_28_x86_64). torch is kept out of
    the resolution with a placeholder wheel at the target's version, so pip never fetches one."""
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pins = list(stack_pins(stack).values())
    _build_deepspeed_wheel(pins, ["--find-links", str(folder)], folder)
    torch = (torch or base_torch()).split("+")[0]
    with tempfile.TemporaryDirectory() as tmp:
        stub = _stub_wheel(Path(tmp), "torch", f"{torch}+stub")
        (Path(tmp) / "constraints.txt").write_text(f"torch=={torch}+stub\n")
        _pip(
            [
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--dest",
                str(folder),
                "--find-links",
                str(stub.parent),
                "--find-links",
                str(folder),
                "--constraint",
                str(Path(tmp) / "constraints.txt"),
                *target_args(python_version, platforms),
                *pins,
            ],
            what=f"downloading {' '.join(pins)}",
        )
    for placeholder in folder.glob("torch-*+stub-*.whl"):
        placeholder.unlink()
    return sorted(p.name for p in folder.glob("*.whl"))


def _stub_wheel(folder: Path, name: str, ver: str) -> Path:
    """A wheel that only says `name ver` exists (no files): it stands for the target's torch in a resolution."""
    dist = f"{name}-{ver}.dist-info"
    path = folder / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: dsexp\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def target_args(python_version: Optional[str], platforms: Sequence[str] = ()) -> List[str]:
    """pip's options for downloading another interpreter's wheels (CPython `python_version`, e.g. "3.12", on
    `platforms`, default manylinux x86_64); none for this interpreter's own."""
    if not python_version:
        return []
    args = [
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--abi",
        "cp" + python_version.replace(".", ""),
    ]
    for plat in platforms or ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        args += ["--platform", plat]
    return args


# --- filling the wheelhouse of dsexp's own job environment on a GPU machine ---------------------------------

# A GPU machine whose image has torch, transformers, accelerate, safetensors, numpy, pandas, matplotlib, psutil,
# nvidia-ml-py and filelock, but no network and none of DeepSpeed, hydra-core, omegaconf, MLflow or pydantic (the
# lent H200s: docs/gpu.md). These are what the job process imports there and the image lacks, with no dependency
# left to resolve (each is downloaded with --no-deps): versions known to install and import together on its
# CPython 3.12. MLflow is mlflow-skinny (the client: tracking into sqlite needs no server).
JOB_WHEELS = (
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "hjson==3.1.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "mlflow-skinny==3.17.2",
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-proto==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "sqlparse==0.6.1",
    "cachetools==7.3.3",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "importlib-metadata==9.1.0",
    "databricks-sdk==0.162.0",
    "sqlalchemy==2.1.9",
    "alembic==1.20.1",
    "mako==1.4.3",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",
    "google-auth==2.63.0",
    "pyasn1==0.6.5",
    "pyasn1-modules==0.4.2",
    "python-dotenv==1.2.4",
    "uvicorn==0.54.0",
    "gitpython==3.2.1",
    "gitdb==4.0.12",
    "smmap==5.0.3",
    # quant= (dsexp.quant): torchao's members and transformers' quantized KV cache (quanto backend); torchao's abi3
    # wheel runs its Python paths on the image's torch 2.11 (its compiled extras are optional)
    "torchao==0.18.0",
    "optimum-quanto==0.2.7",
)
# Published as source archives only: built here into pure-Python wheels (DeepSpeed with DS_BUILD_OPS=0: the GPU
# machine JIT-builds any op it needs with its own nvcc).
JOB_SOURCE_ONLY = ("antlr4-python3-runtime==4.9.3",)
JOB_DEEPSPEED = "deepspeed==0.19.8"


def fill_job(folder: Path, python_version: Optional[str] = None, platforms: Sequence[str] = ()) -> List[str]:
    """Download and build into `folder` the wheels dsexp's job environment needs on such a GPU machine (JOB_WHEELS,
    JOB_SOURCE_ONLY, JOB_DEEPSPEED), for this Python or another one (python_version "3.12"); the machine installs
    them with `pip install --no-index --no-deps` (scripts/gpu/env.sh, docs/gpu.md). Returns the folder's wheel names."""
    folder = Path(folder).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    _pip(
        [
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(folder),
            *target_args(python_version, platforms),
            *JOB_WHEELS,
        ],
        what="downloading the job environment's wheels",
    )
    _pip(
        ["wheel", "--quiet", "--no-deps", "--wheel-dir", str(folder), *JOB_SOURCE_ONLY],
        what=f"building {' '.join(JOB_SOURCE_ONLY)} into wheels",
    )
    _build_deepspeed_wheel([JOB_DEEPSPEED], ["--find-links", str(folder)], folder)
    return sorted(p.name for p in folder.glob("*.whl"))
