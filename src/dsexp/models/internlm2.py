"""InternLM2 architecture for the writer: its config, its model class, and the remote code it ships.

The modeling files live in `dsexp/models/remote_code/internlm2/` and are copied into every generated
checkpoint folder, whose config.json maps AutoConfig/AutoModelForCausalLM to them (`auto_map`), so the
folder loads with `trust_remote_code=True` exactly as InternLM2-chat-20b does.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any, Dict

REMOTE_CODE_DIR = Path(__file__).parent / "remote_code" / "internlm2"
REMOTE_FILES = ("configuration_internlm2.py", "modeling_internlm2.py")
AUTO_MAP = {
    "AutoConfig": "configuration_internlm2.InternLM2Config",
    "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
}


def make_config(dims: Dict[str, Any], torch_dtype_name: str):
    from dsexp.models.remote_code.internlm2.configuration_internlm2 import InternLM2Config

    cfg = InternLM2Config(**dims, dtype=torch_dtype_name)
    cfg.auto_map = dict(AUTO_MAP)
    cfg.architectures = ["InternLM2ForCausalLM"]
    return cfg


def model_class():
    from dsexp.models.remote_code.internlm2.modeling_internlm2 import InternLM2ForCausalLM

    return InternLM2ForCausalLM


def write_remote_code(folder: Path) -> None:
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, Path(folder) / name)


def code_digest() -> str:
    """Changes whenever the shipped modeling code does, so cached checkpoints are rewritten with it."""
    h = hashlib.sha1()
    for name in REMOTE_FILES:
        h.update((REMOTE_CODE_DIR / name).read_bytes())
    return h.hexdigest()[:12]
