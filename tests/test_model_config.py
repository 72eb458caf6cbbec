"""model=config: any transformers architecture by model_type and dims, or a folder holding only config.json (and its
remote code), written as random weights at those exact shapes into the cache."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from dsexp.compose.config import to_schema
from dsexp.core.schema import ConfigError
from dsexp.models.internlm2 import REMOTE_CODE_DIR, REMOTE_FILES
from dsexp.models.writer import checkpoint_key, ensure_checkpoint, meta_model

from helpers.run import CONF, compose, spec_of

MISTRAL = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def dims_arg(dims):
    return "+model.dims={" + ",".join(f"{k}:{v}" for k, v in dims.items()) + "}"


def internlm2_config_folder(folder):
    """A folder as InternLM2's authors publish it, without weights: config.json + the modeling code."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, folder / name)
    cfg = {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_internlm2.InternLM2Config",
            "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
        },
        "model_type": "internlm2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def test_a_transformers_model_type_with_dims_validates_and_reads_its_heads():
    spec = spec_of("model=config", "model.arch=mistral", dims_arg(MISTRAL), "tp=2")
    assert (spec.model.name, spec.model.arch, spec.model.dims["num_key_value_heads"]) == ("config", "mistral", 2)
    with pytest.raises(ConfigError, match="the model has 2 key/value heads"):
        spec_of("model=config", "model.arch=mistral", dims_arg(MISTRAL), "tp=4")


def test_an_architecture_class_name_is_its_model_type():
    spec = spec_of("model=config", "model.arch=MistralForCausalLM", dims_arg(MISTRAL))
    assert meta_model(spec.model.arch, spec.model.dims, "bf16")[0].model_type == "mistral"


def test_an_unknown_model_type_names_the_key_and_close_matches():
    with pytest.raises(ConfigError) as e:
        spec_of("model=config", "model.arch=mistrall")
    assert "model.arch='mistrall'" in str(e.value) and "close matches: mistral" in str(e.value)


def test_dims_transformers_refuses_name_the_key():
    with pytest.raises(ConfigError, match="transformers cannot build a config from model.arch='mistral'"):
        spec_of("model=config", "model.arch=mistral", "+model.dims={hidden_size:100,num_attention_heads:3}")


def test_config_folder_checks(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        spec_of("model=config", f"model.config_path={tmp_path}")
    folder = internlm2_config_folder(tmp_path / "ilm2")
    with pytest.raises(ConfigError, match="trust_remote_code=true explicitly"):
        spec_of("model=config", f"model.config_path={folder}")
    spec = spec_of("model=config", f"model.config_path={folder}", "model.trust_remote_code=true", "tp=2")
    assert spec.model.config_path == str(folder)


def test_the_matrix_presets_are_model_config():
    """conf/model/tiny_<arch>.yaml build on model/config: an architecture and dims, random weights, no folder."""
    presets = sorted(p.stem for p in (CONF / "model").glob("tiny_*.yaml"))
    assert len(presets) >= 10
    for name in presets:
        assert yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())["defaults"][0] == "config"
        spec = to_schema(compose([f"model={name}"]))
        assert spec.model.name == name and spec.model.arch and spec.model.dims and spec.variant is None
        assert spec.model.path is None and spec.model.config_path is None


def test_config_folder_is_written_with_its_code_and_keyed_by_its_content(tmp_path):
    folder = internlm2_config_folder(tmp_path / "ilm2")
    st = ensure_checkpoint(
        str(tmp_path / "cache"), "config", None, {}, "bf16", config_path=str(folder), trust_remote_code=True
    )
    names = {p.name for p in st.path.iterdir()}
    assert {"config.json", *REMOTE_FILES, "model-00001-of-00001.safetensors"} <= names
    written = json.loads((st.path / "config.json").read_text())
    assert written["auto_map"]["AutoModelForCausalLM"] == "modeling_internlm2.InternLM2ForCausalLM"
    assert written["hidden_size"] == 128
    keys = [checkpoint_key(None, {}, "bf16", "safetensors", 0, 100, str(folder))]
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    keys.append(checkpoint_key(None, {}, "bf16", "safetensors", 0, 100, str(folder)))
    with open(folder / "modeling_internlm2.py", "a") as f:
        f.write("\n# edited\n")
    keys.append(checkpoint_key(None, {}, "bf16", "safetensors", 0, 100, str(folder)))
    assert len(set(keys)) == 3  # config.json and the code are both part of the key


def test_model_type_checkpoint_has_the_exact_shapes(tmp_path):
    from safetensors import safe_open

    st = ensure_checkpoint(str(tmp_path), "config", "qwen2_moe", {**MISTRAL, "num_experts": 4}, "bf16")
    cfg, model = meta_model("qwen2_moe", {**MISTRAL, "num_experts": 4}, "bf16")
    with safe_open(str(st.path / "model-00001-of-00001.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = {n: tuple(p.shape) for n, p in model.state_dict().items() if n in shapes}
    assert shapes == want and any(len(s) == 3 for s in shapes.values())  # the experts are 3-D parameters
    assert json.loads((st.path / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]


def test_shared_buffers_of_a_config_folder_come_from_its_own_config(tmp_path):
    """The memory model's shared-buffer map (trim.dedupe_buffers) of a config-only folder whose run folder is not on
    this machine: built from the folder's config.json and code, as the placement is (not from arch + dims)."""
    from dsexp.predict.architecture import model_source
    from dsexp.trims.dedupe_buffers.placement import duplicates

    folder = internlm2_config_folder(tmp_path / "cfg")
    model = {"name": "config", "arch": None, "dims": {}, "config_path": str(folder), "trust_remote_code": True}
    shared = duplicates(model_source({"model": model}, None), "bf16")
    # 2 layers, each with its own inv_freq and cos/sin tables: layer 1's three are layer 0's
    assert shared == {
        f"model.layers.1.attention.rotary_emb.{b}": f"model.layers.0.attention.rotary_emb.{b}"
        for b in ("inv_freq", "cos_cached", "sin_cached")
    }
