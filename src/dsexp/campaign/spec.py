"""A campaign file (campaigns/<name>.yaml): the steps that remake one results folder, as data.

    about: what it measures                  results: results/h200/shared (the folder it fills; $OUT)
    machine: what it needs                   findings: [the FINDINGS sections that read it]
    env: {USE_FLAX: "0"}                     models: {D20: [model=internlm2_20b_shapes]} (written first; $D20)
    common: [model=..., launcher.gpus=1]     frozen: why it cannot be remade (dry runs only)
    steps:
      - {name: autotp2, overrides: [experiment=autotp, tp=2], timeout_s: 300}   # python -m dsexp -m ... -> $OUT/autotp2
      - {name: tests, pytest: [-m, gpu, tests], timeout_s: 300, stdout: $OUT/gpu_tests.txt}
      - {name: target, command: [python, benchmarks/shared_target.py, --out, $OUT/target.md], timeout_s: 60}

A sweep step runs `python -m dsexp -m <its overrides> <common> hydra.sweep.dir=$WORK/<name>` (a common override
whose key the step sets is left out) and its compact results (CAMPAIGN_KEEP) are copied to $OUT/<name>. In every
string, $OUT, $WORK, $REPO, a model's name and the environment's variables are substituted (Hydra's ${...}
interpolations are left alone)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import yaml

from dsexp.core.schema import ConfigError

REPO = Path(__file__).resolve().parents[3]
CAMPAIGNS = REPO / "campaigns"
KINDS = ("overrides", "pytest", "command")
STEP_KEYS = {"name", "timeout_s", "stdout", "env", *KINDS}
CAMPAIGN_KEYS = {"about", "machine", "results", "findings", "env", "models", "common", "frozen", "steps"}


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # overrides (a dsexp sweep), pytest or command
    args: List[str]
    timeout_s: int
    stdout: Optional[str] = None  # a file for the step's standard output (else it goes to the log)
    env: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Campaign:
    name: str
    about: str
    machine: str
    results: str  # relative to the repo root
    findings: List[str]
    steps: List[Step]
    common: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    models: Dict[str, List[str]] = field(default_factory=dict)
    frozen: Optional[str] = None


def names() -> List[str]:
    return sorted(p.stem for p in CAMPAIGNS.glob("*.yaml"))


def load(name: str) -> Campaign:
    path = CAMPAIGNS / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no campaign {name!r} (campaigns/{name}.yaml); there are: {', '.join(names())}")
    return parse(name, yaml.safe_load(path.read_text()) or {})


def _strings(where: str, value) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ConfigError(f"{where}: a list of strings, got {value!r}")
    return [str(v) for v in value]


def _env(where: str, value) -> Dict[str, str]:
    if not isinstance(value or {}, dict):
        raise ConfigError(f"{where}: a mapping of variable -> value, got {value!r}")
    return {str(k): str(v) for k, v in (value or {}).items()}


def parse_step(campaign: str, raw: dict) -> Step:
    where = f"campaign {campaign}, step {raw.get('name', '?') if isinstance(raw, dict) else raw!r}"
    if not isinstance(raw, dict) or set(raw) - STEP_KEYS:
        raise ConfigError(f"{where}: unknown keys {sorted(set(raw) - STEP_KEYS) if isinstance(raw, dict) else raw}")
    kinds = [k for k in KINDS if k in raw]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", str(raw.get("name", ""))):
        raise ConfigError(f"{where}: a name of letters, digits, _.- (and / for a sub-folder)")
    if not isinstance(raw.get("timeout_s"), int) or raw["timeout_s"] <= 0:
        raise ConfigError(f"{where}: timeout_s, a whole number of seconds > 0")
    args = _strings(where, raw[kinds[0]])
    return Step(raw["name"], kinds[0], args, raw["timeout_s"], raw.get("stdout"), _env(where, raw.get("env")))


def parse(name: str, raw: dict) -> Campaign:
    unknown = set(raw) - CAMPAIGN_KEYS
    if unknown:
        raise ConfigError(f"campaign {name}: unknown keys {sorted(unknown)}")
    missing = [k for k in ("about", "machine", "results", "findings", "steps") if not raw.get(k)]
    if missing:
        raise ConfigError(f"campaign {name}: missing {', '.join(missing)}")
    steps = [parse_step(name, s) for s in raw["steps"]]
    seen = [s.name for s in steps]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"campaign {name}: step names repeat: {seen}")
    if not str(raw["results"]).startswith("results/"):
        raise ConfigError(f"campaign {name}: results must be a folder under results/, got {raw['results']!r}")
    models = {str(k): _strings(f"campaign {name}, model {k}", v) for k, v in (raw.get("models") or {}).items()}
    return Campaign(
        name=name,
        about=" ".join(str(raw["about"]).split()),
        machine=str(raw["machine"]),
        results=str(raw["results"]).rstrip("/"),
        findings=_strings(f"campaign {name}, findings", raw["findings"]),
        steps=steps,
        common=_strings(f"campaign {name}, common", raw.get("common") or []),
        env=_env(f"campaign {name}, env", raw.get("env")),
        models=models,
        frozen=raw.get("frozen"),
    )


def override_key(override: str) -> str:
    """The key an override sets: `++trim.env={...}` -> trim.env."""
    return override.split("=", 1)[0].lstrip("+~")


def sweep_overrides(campaign: Campaign, step: Step, add: Sequence[str] = ()) -> List[str]:
    """A sweep step's overrides, then the campaign's common ones whose keys the step does not set; `add` (the
    command line's) after them, in place of any that set the same keys."""

    def without(overrides: Sequence[str], keys: Iterable[str]) -> List[str]:
        drop = set(keys)
        return [o for o in overrides if override_key(o) not in drop]

    own = step.args + without(campaign.common, map(override_key, step.args))
    return without(own, map(override_key, add)) + list(add)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """$NAME and ${NAME} from `values`; anything else (Hydra's ${oc.env:X}, an unknown $X) as written."""
    return string.Template(text).safe_substitute(values)
