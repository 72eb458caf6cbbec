"""The README and docs/ say only what is so: links resolve, named make targets, modules and repo paths exist, nothing
points outside the project, and the configuration reference names every key and option."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import typing
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from dsexp.core.schema import JobConfig

from helpers.run import CONF, ROOT
from helpers.tables import publish

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("conf", "campaigns", "src", "tests", "scripts", "docs", "results", "benchmarks", "examples", ".ci")
OUTSIDE = ("/work/", "shared/gpu")
# `make TARGET` as a command: at the start of a line or code span (after VAR=value settings), or in $(...)
MAKE = r"(?:^\s*(?:[A-Z_]+=\S+\s+)*|\$\()make (?:-s )?([a-z][a-z-]*)"
UP = r"(?<![.\w])(?:\.\./)+[^\s)`'\",;]*"  # a relative path that climbs: ../x (not an ellipsis: .../x)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_of(text: str) -> List[str]:
    """The fenced code blocks and inline code spans of a markdown text."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def links(text: str) -> Iterator[Tuple[str, str]]:
    """(target, anchor) of every markdown link and image outside code."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        path, _, anchor = target.partition("#")
        yield path, anchor


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"^```[^\n]*\n.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve_to_files_of_the_repo(page):
    bad = []
    for path, anchor in links(page.read_text()):
        if re.match(r"[a-z]+:", path):  # http(s):, mailto:
            continue
        target = (page.parent / path).resolve() if path else page
        if ROOT not in target.parents or not target.exists():
            bad.append(f"{path}: no such file in the repo")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{path}#{anchor}: no such heading")
    assert not bad


def test_makefile_targets_named_exist():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    assert {"sweep", "test", "lint", "install"} <= targets
    for page in PAGES:
        named = {t for code in code_of(page.read_text()) for t in re.findall(MAKE, code, re.M)}
        assert named <= targets, (page_id(page), sorted(named - targets))


def test_python_modules_named_are_importable():
    seen = set()
    for page in PAGES:
        for code in code_of(page.read_text()):
            for module in re.findall(r"\bpython3? -m ([A-Za-z_][\w.]*)", code):
                seen.add(module)
                assert importlib.util.find_spec(module) is not None, (page_id(page), module)
    assert {"dsexp", "dsexp.report", "dsexp.sync", "dsexp.stacks"} <= seen


def repo_paths(code: str) -> Iterator[str]:
    """Tokens of a code span or block that name a file or folder of the repo (`dsexp/...`: under src/)."""
    for token in re.split(r"[\s\"'(),;=]+", code):
        token = token.split("::")[0].rstrip(".:")
        if token.startswith("dsexp/"):
            token = "src/" + token
        if token.split("/")[0] in REPO_DIRS and "/" in token or token in ("Makefile", "pyproject.toml"):
            yield token


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_repo_paths_named_exist(page):
    missing, checked = [], 0
    for code in code_of(page.read_text()):
        for path in repo_paths(code):
            if re.search(r"[<>{}$]", path):  # a placeholder: results/<machine>/bench.{json,md}
                continue
            checked += 1
            if not list(ROOT.glob(path)) if "*" in path else not (ROOT / path).exists():
                missing.append(path)
    assert not missing
    assert checked or page.name == "notes-slurm.md" or page.name.startswith("FINDINGS")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_nothing_points_outside_the_project(page):
    text = page.read_text()
    assert not [s for s in OUTSIDE if s in text]
    for up in re.findall(UP, text):
        target = (page.parent / up).resolve()
        assert ROOT in target.parents and target.exists(), f"{page_id(page)}: {up}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    text = "see [x](nope.md), [y](#nowhere), `make nosuch`, `python -m no_such_module`, `tests/no_such.py`"
    assert [p for p, _ in links(text)] == ["nope.md", ""] and slug("`debug`: a, b's") == "debug-a-bs"
    codes = code_of(text)
    assert "make nosuch" in codes and "python -m no_such_module" in codes
    assert re.findall(MAKE, 'make a\nX=1 make b\neval "$(make -s c)"\n# what it would make itself', re.M) == [
        "a",
        "b",
        "c",
    ]
    assert importlib.util.find_spec("no_such_module") is None
    assert list(repo_paths("bash scripts/gpu/x.sh tests/a.py::test_b dsexp/core/fs.py")) == [
        "scripts/gpu/x.sh",
        "tests/a.py",
        "src/dsexp/core/fs.py",
    ]
    assert re.findall(UP, "run ../shared/gpu/wheels.sh, not .../bf16") == ["../shared/gpu/wheels.sh"]


def keys_of(cls, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a schema dataclass, nested groups included (`model.arch`, `tp`, ...)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from keys_of(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_the_configuration_reference_names_every_key_and_option():
    """docs/configuration.md: every key of the job's schema and every option of every config group."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    spans = set(re.findall(r"`([^`\n]+)`", text))
    keys = list(keys_of(JobConfig))
    assert "model.arch" in keys and "stack.wheelhouse" in keys and "fault" in keys
    missing = [k for k in keys if k not in spans and f"`{k}`" not in text]
    assert not missing, f"keys not in docs/configuration.md: {missing}"
    groups = [g for g in CONF.rglob("*") if g.is_dir()]
    options = [(str(g.relative_to(CONF)), p.stem) for g in groups for p in g.glob("*.yaml")]
    assert ("model", "tiny_llama") in options and ("debug", "fault") in options
    missing = [f"{g}={o}" for g, o in options if g != "hydra" and o not in spans]
    assert not missing, f"options not in docs/configuration.md: {missing}"


def test_tables_the_slow_tests_publish_have_their_markers(tmp_path):
    """The slow matrix tests write their tables between markers in docs/; without the markers they fail."""
    for page, marker in (("user-guide.md", "arch-matrix"), ("reliability.md", "fault-matrix")):
        text = (ROOT / "docs" / page).read_text()
        assert f"<!-- {marker}:begin -->" in text and f"<!-- {marker}:end -->" in text, page
    doc = tmp_path / "page.md"
    doc.write_text("a\n<!-- t:begin -->\nold\n<!-- t:end -->\nb\n")
    assert publish("| new |\n", tmp_path / "r.md", "test", "t", doc) == "| new |\n"
    assert doc.read_text() == "a\n<!-- t:begin -->\n| new |\n<!-- t:end -->\nb\n"
    assert (tmp_path / "r.md").read_text() == "<!-- generated by test; do not edit -->\n| new |\n"
    with pytest.raises(ValueError, match="no <!-- u:begin -->"):
        publish("x", tmp_path / "r.md", "test", "u", doc)


def test_make_help_names_every_entry_point_with_an_example_that_parses():
    """`make help` ends with dsexp's entry points: the app (a sweep, a budget search), the plan, the report and the
    campaigns, each with one example whose module exists."""
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    examples = [line.split() for line in out.stdout.split("Entry points", 1)[1].splitlines()[1:]]
    modules = [words[0] for words in examples if words and words[0].startswith("dsexp")]
    assert {"dsexp", "dsexp.plan", "dsexp.report", "dsexp.campaign"} <= set(modules), out.stdout
    assert all(importlib.util.find_spec(m) is not None for m in modules)
    assert any(w.startswith("budget.gpu_gib=") for words in examples for w in words), out.stdout


def test_the_user_guides_contents_list_every_section():
    """The list under the guide's title links every `## ` section of it, in the guide's order."""
    text = (ROOT / "docs" / "user-guide.md").read_text()
    body = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    sections = [slug(h) for h in re.findall(r"^## (.+)$", body, re.M)]
    contents = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", text.split("\n## ", 1)[0], re.M)
    assert contents == sections
