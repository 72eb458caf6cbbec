"""Security properties a reading of the source can show: no shell strings, no eval of config values, remote
code only on request, the UI on localhost only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.schema import ConfigError

from helpers.run import CONF, ROOT, compose

SOURCES = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
SUBPROCESS = {"run", "Popen", "call", "check_call", "check_output"}


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def name_of(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{name_of(func.value)}.{func.attr}"
    return ""


def test_sources_were_found():
    assert any(p.name == "launch.py" for p in SOURCES) and len(SOURCES) > 20


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_shell_strings_and_no_eval(path):
    for call in calls(path):
        name = name_of(call.func)
        where = f"{path.relative_to(ROOT)}:{call.lineno}"
        assert name not in ("eval", "exec", "compile", "os.system", "os.popen", "__import__"), where
        for kw in call.keywords:
            assert not (kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)), (
                where
            )
            assert not (kw.arg == "trust_remote_code" and isinstance(kw.value, ast.Constant) and kw.value.value), where
            assert not (kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False), (
                where
            )
        if name.split(".")[-1] in SUBPROCESS and name.split(".")[0] in ("subprocess", "sp") and call.args:
            assert not isinstance(call.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)), f"{where}: a command string"


def test_resolvers_are_plain_functions_and_job_configs_are_not_instantiated():
    """A config can only call the resolvers registered here: each must be a function of this repository (it
    cannot be eval/exec, whose arguments would come from the config). Job configs are never instantiated."""
    defined = {
        node.name
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
    }
    for path in SOURCES:
        for call in calls(path):
            if name_of(call.func).endswith("register_new_resolver"):
                fn = call.args[1]
                assert isinstance(fn, ast.Name) and fn.id in defined, f"{path.relative_to(ROOT)}:{call.lineno}"
    text = "\n".join(p.read_text() for p in SOURCES)
    assert not re.search(r"\binstantiate\(", text)


def sets_remote_code(preset: str) -> bool:
    """Whether the preset's YAML, or one it builds on through its defaults list, says trust_remote_code: true."""
    import yaml

    data = yaml.safe_load((CONF / "model" / f"{preset}.yaml").read_text()) or {}
    bases = [d for d in data.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return data.get("trust_remote_code") is True or any(sets_remote_code(b) for b in bases)


def test_remote_code_is_off_unless_a_config_says_so():
    assert to_schema(compose()).model.trust_remote_code is False
    for path in sorted((CONF / "model").glob("*.yaml")):
        over = [f"model={path.stem}"] + (["model.path=/nonexistent"] if path.stem == "local" else [])
        assert to_schema(compose(over)).model.trust_remote_code == sets_remote_code(path.stem), path.name


def test_a_folder_with_modeling_code_needs_the_explicit_switch(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "auto_map": {"AutoModel": "m.M"}}))
    (tmp_path / "m.py").write_text("raise SystemExit('must not run')\n")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="trust_remote_code=true explicitly"):
        validate(to_schema(compose(["model=local", f"model.path={tmp_path}"])), gpus=0)


def test_make_ui_binds_localhost():
    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")  # join continued lines
    ui = [line for line in make.splitlines() if "mlflow ui" in line or "mlflow server" in line]
    assert ui and all("--host 127.0.0.1" in line for line in ui)
    assert "0.0.0.0" not in make
