"""The lines a user changes in their script to do what the remedies did (script.fix), built from what the run
recorded: the class and folder the script loaded, the dtype and remote-code flag it passed, the engine call as the
remedies made it. The result is Python a user can paste: it imports nothing from dsexp and names only what the run
saw; where a remedy has no few-line equivalent, a comment says so and why."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.analysis.user_script import applied_fixes, first_call

TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}
AUTO_LOADERS = ("AutoModelForCausalLM", "AutoModel", "AutoModelForSeq2SeqLM")


def code_lines(result: Dict[str, Any]) -> List[str]:
    """The remedies rank 0 applied, as Python lines, the engine call last as the remedies made it; [] where none
    applied."""
    applied = applied_fixes(result)
    names = Names(first_call(result, "load") or {}, first_call(result, "init") or {})
    out: List[str] = []
    for remedy in SCRIPT_ORDER:
        if remedy in applied:
            out += LINES[remedy](applied[remedy], names)
    if names.engine_changes:
        out += ["# the engine call, as the remedies made it", names.init_call()]
    return out


class Names:
    """What the run recorded about the script's load and engine call, as Python source fragments."""

    def __init__(self, load: Dict[str, Any], init: Dict[str, Any]):
        kw = load.get("kwargs") or {}
        self.source = load.get("source_expr") or repr(str(load.get("source")))  # the script's own name for it
        loader = str(load.get("api") or "AutoModelForCausalLM.from_pretrained").split(".")[0]
        self.loader = loader if loader in AUTO_LOADERS or loader.endswith("ForCausalLM") else "AutoModelForCausalLM"
        self.remote = bool(kw.get("trust_remote_code"))
        self.dtype = _torch_dtype(kw.get("torch_dtype") or kw.get("dtype")) or _torch_dtype(
            (load.get("config") or {}).get("torch_dtype") or (load.get("config") or {}).get("dtype")
        )
        self.engine_kwargs = dict(init.get("called_with") or init.get("given") or {})
        self.engine_changes: Dict[str, str] = {}  # init_inference's arguments a remedy sets, as Python source

    def remote_kw(self) -> str:
        return ", trust_remote_code=True" if self.remote else ""

    def dtype_kw(self) -> str:
        return f", torch_dtype={self.dtype}" if self.dtype else ""

    def init_call(self) -> str:
        """deepspeed.init_inference(model, ...) with the arguments the run passed it, the remedies' as they set them."""
        args = {k: _source(v) for k, v in self.engine_kwargs.items() if k not in ("checkpoint", "injection_policy")}
        args.update(self.engine_changes)
        return "engine = deepspeed.init_inference(model" + "".join(f", {k}={v}" for k, v in args.items()) + ")"


def _torch_dtype(value: Any) -> Optional[str]:
    text = str(value or "").replace("torch.", "")
    short = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(text, text)
    return TORCH_DTYPES.get(short)


def _source(value: Any) -> str:
    """A recorded argument as Python source: dtypes as torch's names, the rest as literals."""
    if isinstance(value, str) and value.startswith("torch.") and _torch_dtype(value):
        return _torch_dtype(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_source(v)}" for k, v in value.items()) + "}"
    fields = _config_fields(value)
    return _source(fields) if fields else repr(value)


def _config_fields(value: Any) -> Optional[Dict[str, Any]]:
    """A DeepSpeed config object as the run recorded it, by its repr ("enabled=True tp_size=2 mpu=None", pydantic's
    str), as the dict DeepSpeed accepts in its place, unset (None) fields left out; None: not such a repr."""
    parts = str(value).split() if isinstance(value, str) else []
    if not parts or not all("=" in p and p.split("=", 1)[0].isidentifier() for p in parts):
        return None
    literal = {"True": True, "False": False, "None": None}
    out: Dict[str, Any] = {}
    for key, raw in (p.split("=", 1) for p in parts):
        val = literal.get(raw, int(raw) if raw.lstrip("-").isdigit() else raw.strip("'\""))
        if val is not None:
            out[key] = val
    return out


def _meta_load(done: List[Any], n: Names) -> List[str]:
    info = next((d for d in done if isinstance(d, dict) and "filled_by" in d), {})
    if info.get("filled_by") == "dsexp":
        return ["# meta_load at world size 1: init_inference reads no checkpoint= here, so keep from_pretrained"]
    n.engine_changes["checkpoint"] = "checkpoint"
    return [
        "# instead of from_pretrained: build on the meta device, init_inference loads each rank's part",
        "import glob, os",
        "from transformers import AutoConfig",
        f"config = AutoConfig.from_pretrained({n.source}{n.remote_kw()})",
        f"with deepspeed.OnDevice(dtype={n.dtype or 'torch.float32'}, device='meta'):",
        f"    model = {n.loader}.from_config(config{n.remote_kw()}{n.dtype_kw()})",
        f"files = sorted(glob.glob(os.path.join({n.source}, '*.safetensors')))",
        "checkpoint = {'type': 'ds_model', 'checkpoints': files, 'version': 1.0}",
        *[f"# {d}" for d in done if isinstance(d, str) and "before the engine" in d],
    ]


def _restore_buffers(done: List[Any], n: Names) -> List[str]:
    return [
        "# the buffers the model's code computes in __init__ (rotary tables), which this transformers left",
        "# uninitialised, recomputed by a twin built without weights, after from_pretrained and after the engine",
        "from accelerate import init_empty_weights",
        "with init_empty_weights(include_buffers=False):",
        f"    twin = {n.loader}.from_config(model.config{n.remote_kw()}{n.dtype_kw()})",
        "def put_back_buffers(module):",
        "    for name, buf in twin.named_buffers():",
        "        module.get_buffer(name).data = buf.to(module.get_buffer(name).device)",
        "put_back_buffers(model)  # after from_pretrained",
        "# put_back_buffers(engine.module)  # after deepspeed.init_inference",
    ]


def _autotp(done: List[Any], n: Names) -> List[str]:
    policy = next((d.get("injection_policy") for d in done if isinstance(d, dict)), None) or {}
    lines = ["# AutoTP instead of kernel injection, which has no policy for this model's layers"]
    if any("init_distributed" in str(d) for d in done):  # AutoTP asks DeepSpeed's comm for the ranks
        lines.append("deepspeed.init_distributed()")
    entries = []
    for i, (cls, linears) in enumerate(policy.items()):
        lines.append(f"layer_{i} = next(m for m in model.modules() if type(m).__name__ == {cls!r})")
        entries.append(f"type(layer_{i}): {tuple(linears)!r}")
    n.engine_changes["replace_with_kernel_inject"] = "False"
    if entries:
        n.engine_changes["injection_policy"] = "{" + ", ".join(entries) + "}"
    return lines


def _as_comments(done: List[Any], n: Names) -> List[str]:
    """What the remedy changed in the script's own calls, one comment each (the call is the script's to edit)."""
    return [f"# change: {d}" for d in done if isinstance(d, str) and "init_distributed" not in d]


def _trims(done: List[Any], n: Names) -> List[str]:
    return [
        "# trims (head and embedding sharded, one communicator, identical buffers shared) swap modules around",
        "# init_inference by this model's own names (DeepSpeed's VocabParallelEmbedding, LmHeadLinearAllreduce);",
        "# keep script.fix=trims to have them",
    ]


def _context(done: List[Any], n: Names) -> List[str]:
    return [
        "import os  # first lines of the script, before torch is imported",
        "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'",
    ]


# the blocks in the order their lines stand in a script: the environment first, the load, then what comes before
# the engine call (AutoTP's policy reads the model the load built)
SCRIPT_ORDER = ("context", "host_load", "meta_load", "restore_buffers", "drop_unread", "autotp", "trims")

LINES = {
    "context": _context,
    "host_load": _as_comments,
    "meta_load": _meta_load,
    "restore_buffers": _restore_buffers,
    "drop_unread": _as_comments,
    "autotp": _autotp,
    "trims": _trims,
}
