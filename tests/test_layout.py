"""The layout shows the pipeline: imports run one way (no cycles), the ranks need nothing of the job side, and each
engine and each trim is one member of its family, in one folder holding all of it, named nowhere else."""

from __future__ import annotations

import ast
import dataclasses
import functools
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest
import yaml

from helpers.run import CONF, ROOT

SRC = ROOT / "src" / "dsexp"
FAMILIES = ("engines", "trims", "quant")
# What each stage may import from dsexp (itself included): the stages only ever look back. A family's members are
# cut by where each part runs: `rank.py` on the ranks, `placement.py` in the memory model's dispatch, the rest
# ("family": registry, base, each member's traits and validation) wherever its traits are read, the standard library
# and core alone at import (test_family_traits_import_without_torch; the engines' validation asks dsexp.models inside
# functions). The memory model (predict) sits under the families; what the families share with the ranks (the rank's
# context, the config-read tracer, version shims) sits in core.
ALLOWED = {
    "core": {"core"},
    "models": {"core", "models"},
    "predict": {"core", "models", "predict"},
    "family": {"core", "models", "predict", "family"},
    "family.placement": {"core", "models", "predict", "family", "family.placement"},
    "family.rank": {"core", "models", "family", "family.rank"},
    "rank": {"core", "models", "rank", "family", "family.rank"},
    "analysis": {"core", "models", "predict", "analysis", "family", "family.placement"},
    "tracking": {"core", "analysis", "tracking", "family"},
    "job": {"core", "models", "predict", "rank", "tracking", "job", "family"},
    "compose": {"core", "models", "predict", "analysis", "tracking", "job", "compose", "family", "family.placement"},
    "campaign": {"core", "job", "compose", "campaign"},  # runs sweeps (python -m dsexp) as a user would
    "plan": {"compose", "plan"},  # python -m dsexp.plan: the command over compose.planning
}
# Only compose/ and the hydra_plugins package import these; the first two nowhere else at all, the last two
# nowhere else at module level (the job's own process, on a GPU image without them, must import without them).
HYDRA_ONLY = ("hydra", "omegaconf")
HYDRA_ONLY_AT_MODULE_LEVEL = ("submitit", "hydra_plugins")
# Two modules of one file name are two names for one job; `base.py` is each family's base class, by design.
SAME_NAME_ALLOWED: Set[str] = set()
FAMILY_PARTS = ("rank.py", "placement.py")  # every member of a family has them, by design
JOB_SIDE_ONLY = ("hydra", "omegaconf", "mlflow", "pandas", "matplotlib")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def import_graph() -> Dict[str, Set[str]]:
    """dsexp module -> the dsexp modules it imports anywhere: at module level, inside functions, and under
    `if TYPE_CHECKING:` (an annotation's import is an arrow too)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: Dict[str, Set[str]]):
    state: Dict[str, int] = {}
    stack = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def stage(module: str) -> str:
    """The stage a dsexp module belongs to: its package, or for a family's module the part it is."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in FAMILIES:
        return parts[1] if len(parts) > 1 else "dsexp"
    return f"family.{parts[-1]}" if parts[-1] in ("rank", "placement") else "family"


def test_stage_of_a_family_module():
    assert stage("dsexp.engines.hf_tp.rank") == stage("dsexp.engines.rank") == "family.rank"
    assert stage("dsexp.trims.shard_head.placement") == "family.placement"
    assert stage("dsexp.engines.hf_tp") == stage("dsexp.trims.base") == stage("dsexp.trims") == "family"
    assert stage("dsexp.rank.workloads.pipeline") == "rank"


def upward(graph: Dict[str, Set[str]], package: str) -> List[str]:
    """The imports of `package`'s modules that reach outside what the stage may import."""
    return sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if stage(mod) == package
        for dep in deps
        if stage(dep) not in ALLOWED[package] and dep != "dsexp"
    )


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_stages_only_look_back(package):
    bad = upward(import_graph(), package)
    assert not bad, f"{package} imports outside {sorted(ALLOWED[package])}: {bad}"


def test_upward_sees_a_family_reaching_up_even_for_a_type():
    graph = {"dsexp.engines.base": {"dsexp.analysis.memory"}, "dsexp.predict.fit": {"dsexp.engines"}}
    assert upward(graph, "family") == ["dsexp.engines.base -> dsexp.analysis.memory"]
    assert upward(graph, "predict") == ["dsexp.predict.fit -> dsexp.engines"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsexp.analysis import memory\n")
    assert "dsexp.analysis" in imported_names(tree)  # a type-only import is read as an import


def reaching(graph: Dict[str, Set[str]], source: str, target: str) -> List[str]:
    """The imports by a module of package `source` (itself included) of a module of package `target`."""
    under = lambda mod, package: mod == package or mod.startswith(package + ".")  # noqa: E731
    return sorted(
        f"{mod} -> {dep}" for mod, deps in graph.items() if under(mod, source) for dep in deps if under(dep, target)
    )


def test_the_trims_never_import_the_engines():
    """The engines import the trims (their rank code and placement rules call the trims'), never the other way, not
    even lazily or for a type: where a trim's rule needs an engine's traits, the engine hands them in
    (dsexp.trims.base.TrimTraits.engine_problem, asked by dsexp.engines.base.EngineTraits.check)."""
    assert not reaching(import_graph(), "dsexp.trims", "dsexp.engines")
    assert reaching(import_graph(), "dsexp.engines", "dsexp.trims")  # the one direction there is


def test_reaching_sees_a_trim_importing_an_engine():
    graph = {
        "dsexp.trims.base": {"dsexp.core.gates", "dsexp.engines"},
        "dsexp.trims.shard_head.placement": {"dsexp.engines.init_inference.placement"},
        "dsexp.trims": {"dsexp.trims.base"},
        "dsexp.engines.base": {"dsexp.trims"},
        "dsexp.trimsx": {"dsexp.engines"},  # another package whose name starts alike
    }
    assert reaching(graph, "dsexp.trims", "dsexp.engines") == [
        "dsexp.trims.base -> dsexp.engines",
        "dsexp.trims.shard_head.placement -> dsexp.engines.init_inference.placement",
    ]


def test_family_traits_import_without_torch():
    """Validation, the report and the ranks' registry lookups read the families' traits: torch-free at import."""
    code = (
        "import sys, dsexp.engines, dsexp.trims; "
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'omegaconf', 'hydra') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def imported_names(tree: ast.AST, module_level: bool = False) -> List[str]:
    """Absolute module names imported anywhere in `tree` (or only by its top-level statements)."""
    nodes = tree.body if module_level else ast.walk(tree)
    names: List[str] = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def hydra_offenders(src: Path) -> List[str]:
    """Modules under `src` outside dsexp.compose and hydra_plugins that import Hydra, OmegaConf (anywhere) or
    submitit, hydra_plugins (at module level)."""
    offenders = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parts[0] == "hydra_plugins" or rel.parts[:2] == ("dsexp", "compose"):
            continue
        tree = ast.parse(path.read_text())
        offenders += [f"{rel}: {n}" for n in imported_names(tree) if n.split(".")[0] in HYDRA_ONLY]
        top = imported_names(tree, module_level=True)
        offenders += [f"{rel}: {n} (module level)" for n in top if n.split(".")[0] in HYDRA_ONLY_AT_MODULE_LEVEL]
    return offenders


def test_only_compose_and_the_plugins_import_hydra_and_omegaconf():
    """No exemption: the Hydra app (dsexp.compose.app), its callbacks and its launchers are in compose/."""
    assert not hydra_offenders(ROOT / "src")


def test_hydra_rule_sees_an_offender(tmp_path):
    (tmp_path / "dsexp" / "job").mkdir(parents=True)
    job = tmp_path / "dsexp" / "job"
    (job / "x.py").write_text("import submitit\n\n\ndef f():\n    from omegaconf import OmegaConf\n")
    (tmp_path / "dsexp" / "job" / "y.py").write_text("def f():\n    import submitit\n")  # lazily: fine
    (tmp_path / "dsexp" / "compose").mkdir()
    (tmp_path / "dsexp" / "compose" / "z.py").write_text("import hydra\n")  # compose: fine
    assert hydra_offenders(tmp_path) == ["dsexp/job/x.py: omegaconf", "dsexp/job/x.py: submitit (module level)"]


def test_job_never_imports_compose():
    """compose composes and validates, job runs: an arrow from job back into compose is an upward one."""
    upward = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if mod.startswith("dsexp.job")
        for dep in deps
        if dep.startswith("dsexp.compose")
    )
    assert not upward


def test_no_two_modules_of_one_name_doing_different_jobs():
    """`report.py` the command and `report.py` the renderer, say: a reader cannot tell them apart in a traceback
    or a search. Families' `base.py`, their members' `rank.py`/`placement.py` and packages' `__init__.py`/`__main__.py`
    are the exceptions."""
    by_name: Dict[str, List[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        in_family = path.relative_to(ROOT / "src").parts[1] in FAMILIES and path.name in FAMILY_PARTS
        if path.name not in ("__init__.py", "__main__.py", "base.py") and not in_family:
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT / "src")))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SAME_NAME_ALLOWED}
    assert not clashes
    assert all(len(by_name.get(name, [])) > 1 for name in SAME_NAME_ALLOWED), "an allowed clash is gone: drop it"


def members(family: str) -> Set[str]:
    return {p.parent.name for p in (SRC / family).glob("*/__init__.py")}


def parts(family: str, name: str) -> Set[str]:
    return {p.name for p in (SRC / family / name).glob("*.py")}


def test_each_engine_is_one_folder_holding_all_of_it():
    """conf/engine/<name>.yaml, and dsexp/engines/<name>/ with its traits and gate, its rank-side class and its
    placement rule: the registry, the ranks and the memory model find all of it there."""
    from dsexp.engines import ENGINES, part
    from dsexp.engines.rank import get_engine

    configs = {p.stem for p in (CONF / "engine").glob("*.yaml")}
    assert members("engines") == set(ENGINES) == configs, (members("engines"), sorted(ENGINES), configs)
    for name, traits in ENGINES.items():
        assert parts("engines", name) == {"__init__.py", "rank.py", "placement.py"}, name
        assert traits.name == name and get_engine(name).name == name
        assert callable(part(name, "placement").place)


# Trims that move no tensor, so the memory model has no rule for them.
NO_PLACEMENT = {
    "world_group": "a process group",
    "env": "the ranks' environment",
    "last_logits": "no tensor of the weights: its rule is the capacity model's logits term (its last_position_logits)",
}
# Trims that trim=all leaves off, and why (trim=all is what the weights replicate, removed)
NOT_IN_ALL = {"env": "the ranks' environment, set by value", "last_logits": "what generate computes, not a weight"}


def test_each_trim_is_one_folder_holding_all_of_it():
    """trim.<key> of the schema and of conf/trim/all.yaml (NOT_IN_ALL aside), and dsexp/trims/<key>/ with its traits and
    gate, its rank-side code and (where it moves a tensor) its placement rule."""
    from dsexp.core.schema import TrimConfig
    from dsexp.trims import TRIMS

    schema = [f.name for f in dataclasses.fields(TrimConfig) if f.name != "name"]
    conf = [k for k in yaml.safe_load((CONF / "trim" / "all.yaml").read_text()) if k not in ("name", "defaults")]
    assert members("trims") == set(TRIMS) == set(schema) == set(conf) | set(NOT_IN_ALL), (members("trims"), conf)
    assert list(TRIMS) == schema  # the schema's order is the labels' and the report's
    for key, traits in TRIMS.items():
        want = {"__init__.py", "rank.py"} | ({"placement.py"} if key not in NO_PLACEMENT else set())
        assert parts("trims", key) == want and traits.key == key, key


# Modules outside the families that must name an engine or a trim by string, and why. Any other such string is a
# member's knowledge kept outside its folder (a name-keyed registry, a special case by name).
NAMED_OUTSIDE = {
    "dsexp.core.schema": "EngineConfig's default engine (conf/config.yaml picks the same)",
    "dsexp.analysis.user_script": "init_inference: the DeepSpeed call a user's script made, as its ranks recorded it",
    "dsexp.analysis.diagnosis": "each trim's report as its rank code wrote it (engine.trims), in the report's order",
    "dsexp.rank.workloads.script.hooks": "deepspeed.init_inference, the function a user's script calls",
    "dsexp.rank.workloads.script.facts": "deepspeed.init_inference, the function a user's script calls",
    "dsexp.rank.workloads.script.fixes": "deepspeed.init_inference, and the report keys of its trims remedy",
}


def _docstrings(tree: ast.AST) -> Set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


def test_no_module_outside_the_families_names_a_member():
    from dsexp.engines import ENGINES
    from dsexp.trims import TRIMS

    names = (set(ENGINES) | set(TRIMS)) - {"env"}  # "env" is a common word: its uses are found by their imports
    found = {}
    for path in SRC.rglob("*.py"):
        mod = module_name(path)
        if stage(mod).startswith("family"):
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        hits = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names and id(n) not in skip
        }
        if hits:
            found[mod] = sorted(hits)
    assert set(found) <= set(NAMED_OUTSIDE), {m: h for m, h in found.items() if m not in NAMED_OUTSIDE}
    assert set(NAMED_OUTSIDE) <= set(found), f"no longer naming a member: {set(NAMED_OUTSIDE) - set(found)}"


@functools.lru_cache(maxsize=None)
def _bindings(path: Path) -> Set[str]:
    """Names a module binds at its top level."""
    out: Set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def test_every_import_of_dsexp_resolves():
    """Each `dsexp...` import in the code, tests, benchmarks and scripts names a module or a name defined there
    (a moved module is caught here, without running the code that imports it)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    files = [p for d in ("src", "tests", "benchmarks", "scripts", "examples") for p in (ROOT / d).rglob("*.py")]
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [
                    f"{path.name}: {a.name}"
                    for a in node.names
                    if a.name.startswith("dsexp.") and a.name not in modules
                ]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dsexp":
                if node.module not in modules:
                    bad.append(f"{path.name}: {node.module}")
                    continue
                defined = _bindings(modules[node.module])
                bad += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name != "*" and f"{node.module}.{a.name}" not in modules and a.name not in defined
                ]
    assert not bad, bad


def test_loaders_are_one_set():
    from dsexp.core.schema import LOADERS
    from dsexp.rank.loading import REGISTRY, get_loader

    assert set(LOADERS) == set(REGISTRY) == {p.stem for p in (CONF / "load").glob("*.yaml")}
    for name in LOADERS:
        assert get_loader(name).name == name


def test_a_real_rank_imports_nothing_of_the_job_side(tiny_sweep):
    from helpers.run import sweep_results

    _, sweep_dir, _ = tiny_sweep
    ranks = [rk for res in sweep_results(sweep_dir) for rk in res["ranks"]]
    assert ranks and all(rk["software"]["modules"] for rk in ranks)
    for rk in ranks:
        loaded = set(rk["software"]["modules"])
        assert {"torch", "deepspeed", "transformers", "dsexp"} <= loaded
        assert not loaded & set(JOB_SIDE_ONLY), sorted(loaded & set(JOB_SIDE_ONLY))


def test_tests_import_shared_code_from_helpers_never_from_conftest():
    """conftest.py holds fixtures; what tests share as code is in tests/helpers/ (pytest loads conftest itself)."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "conftest"]
    assert not offenders


def test_analysis_reads_records_through_the_typed_record():
    """analysis/ reads a job's ranks and phases through core.result (JobRecord, RankRecord, PhaseRecord), never by
    indexing the JSON's "ranks" or "phases" itself."""
    offenders = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted((SRC / "analysis").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("ranks", "phases")
    ]
    assert not offenders, offenders


def stage_arrows() -> Dict[str, Set[str]]:
    """Stage -> the other stages it imports from (every import, lazy and type-only ones too)."""
    arrows: Dict[str, Set[str]] = {}
    for mod, deps in import_graph().items():
        arrows.setdefault(stage(mod), set()).update(stage(d) for d in deps if d != "dsexp" and stage(d) != stage(mod))
    arrows.pop("dsexp", None)
    return arrows


def house() -> str:
    """The stages drawn from the imports, roof first: each stage over the ones it imports from."""
    arrows = stage_arrows()
    depth: Dict[str, int] = {}

    def level(s: str) -> int:
        if s not in depth:
            depth[s] = 1 + max((level(d) for d in arrows.get(s, ())), default=-1)
        return depth[s]

    rows = sorted(arrows, key=lambda s: (-level(s), s))
    width = max(map(len, rows))
    return "\n".join(
        f"{s:<{width}}  -> {' '.join(sorted(arrows[s], key=lambda d: (level(d), d))) or '-'}" for s in rows
    )


def test_the_house_in_the_user_guide_is_drawn_from_the_imports():
    """docs/user-guide.md shows the stages as the imports make them (regenerate: `python tests/test_layout.py`)."""
    doc = (ROOT / "docs" / "user-guide.md").read_text()
    block = doc.split("<!-- house:begin -->\n```\n", 1)[1].split("\n```\n<!-- house:end -->", 1)[0]
    assert block == house(), "docs/user-guide.md's house is stale: run `python tests/test_layout.py`"


def test_the_house_has_the_families_under_rank_and_analysis_and_predict_under_them():
    arrows = stage_arrows()
    below = lambda s: arrows.get(s, set())  # noqa: E731
    assert "family.rank" in below("rank") and "family.placement" in below("analysis")
    assert "predict" in below("family.placement") and "predict" in below("analysis")
    assert not below("predict") & {"family", "family.placement", "family.rank", "rank", "analysis"}
    for part in ("family", "family.placement", "family.rank"):
        assert not below(part) & {"rank", "analysis", "tracking", "job", "compose"}, part


if __name__ == "__main__":  # rewrite the user guide's house from the imports
    sys.path.insert(0, str(ROOT / "tests"))
    guide = ROOT / "docs" / "user-guide.md"
    head, rest = guide.read_text().split("<!-- house:begin -->\n", 1)
    tail = rest.split("<!-- house:end -->", 1)[1]
    guide.write_text(f"{head}<!-- house:begin -->\n```\n{house()}\n```\n<!-- house:end -->{tail}")
