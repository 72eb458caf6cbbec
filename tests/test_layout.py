"""The layout shows the pipeline: imports run one way (no cycles), the ranks need nothing of the job side,
and every engine is named the same in the traits table, the configs, the ranks and the memory model."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

from helpers.run import CONF, ROOT

SRC = ROOT / "src" / "dsexp"
# What each package may import from dsexp (itself included): the stages only ever look back. compose composes and
# validates, then hands over to job, which runs; job never imports compose. The commands (dsexp/__main__.py,
# report.py, sync.py, stacks.py) sit on top and may import anything.
ALLOWED = {
    "core": {"core"},
    "models": {"core", "models"},
    "rank": {"core", "models", "rank"},
    "analysis": {"core", "models", "analysis"},
    "tracking": {"core", "analysis", "tracking"},
    "job": {"core", "models", "rank", "tracking", "job"},
    "compose": {"core", "models", "analysis", "tracking", "job", "compose"},
}
JOB_SIDE_ONLY = ("hydra", "omegaconf", "mlflow", "pandas", "matplotlib")
# Only compose/ and the hydra_plugins package import these; the first two nowhere else at all, the last two
# nowhere else at module level (the job's own process, on a GPU image without them, must import without them).
HYDRA_ONLY = ("hydra", "omegaconf")
HYDRA_ONLY_AT_MODULE_LEVEL = ("submitit", "hydra_plugins")
# Two modules of one file name are two names for one job; `base.py` is each family's base class, by design.
SAME_NAME_ALLOWED = {
    "trims.py",  # trims: merged into one family by the engine/trim refactor
}


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
    or a search. Families' `base.py` and packages' `__init__.py`/`__main__.py` are the exceptions."""
    by_name: Dict[str, List[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py", "base.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT / "src")))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SAME_NAME_ALLOWED}
    assert not clashes
    assert all(len(by_name.get(name, [])) > 1 for name in SAME_NAME_ALLOWED), "an allowed clash is gone: drop it"


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
