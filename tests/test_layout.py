"""The layout shows the pipeline: imports run one way (no cycles), the ranks need nothing of the job side,
and every engine is named the same in the traits table, the configs, the ranks and the memory model."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set

import pytest

from helpers.run import CONF, ROOT

SRC = ROOT / "src" / "dsexp"
# What each package may import from dsexp (itself included): the stages only ever look back.
ALLOWED = {
    "core": {"core"},
    "models": {"core", "models"},
    "rank": {"core", "models", "rank"},
    "analysis": {"core", "models", "analysis"},
}
JOB_SIDE_ONLY = ("hydra", "omegaconf", "mlflow", "pandas", "matplotlib")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> Dict[str, Set[str]]:
    """dsexp module -> the dsexp modules it imports anywhere (module level or inside functions)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_stages_only_look_back(package):
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in import_graph().items()
        if mod.startswith(f"dsexp.{package}")
        for dep in deps
        if dep.split(".")[1] not in ALLOWED[package] | {"__init__"} and dep != "dsexp"
    )
    assert not bad, f"dsexp.{package} imports outside {sorted(ALLOWED[package])}: {bad}"


def test_only_compose_imports_hydra_and_omegaconf():
    offenders = []
    for path in SRC.rglob("*.py"):
        mod = module_name(path)
        if mod.startswith(("dsexp.compose", "dsexp.job.cluster_launchers")) or mod == "dsexp.__main__":
            continue  # the Hydra app, its callbacks and its launcher plugins
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{mod}: {n}" for n in names if n.split(".")[0] in ("hydra", "omegaconf")]
    assert not offenders


def test_engines_are_one_set():
    from dsexp.analysis.memory import PLACERS
    from dsexp.core.engines import ENGINES
    from dsexp.rank.engines import get_engine

    configs = {p.stem for p in (CONF / "engine").glob("*.yaml")}
    assert set(ENGINES) == configs == set(PLACERS), (sorted(ENGINES), sorted(configs), sorted(PLACERS))
    for name in ENGINES:
        assert get_engine(name).name == name


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
