"""Remedies dsexp applies to a user's script through its hooks (`script.fix=[...]`), without editing it.

Each remedy acts on the calls the script makes and records what it changed (or why it did not apply here):

host_load        the model stays on the host until the engine places it: from_pretrained's GPU device_map dropped,
                 .cuda()/.to(<GPU>) before the engine skipped, pipeline(device=<GPU>) built on the host (its device
                 set back once the engine has placed the model)
autotp           kernel injection for layers DeepSpeed has no kernel policy for (it would replace and shard nothing)
                 turned off, with the AutoTP policy dsexp infers (dsexp.models.policy)
drop_unread      what DeepSpeed never reads or rejects: init_inference's zero= block; a field the installed
                 DeepSpeed refuses in DeepSpeedZeroConfig (mics_shard_size on 0.19), dropped with the version named
restore_buffers  the loaded model's non-persistent buffers recomputed from its own constructor (published remote code
                 whose rotary tables transformers >= 5 leaves uninitialised) and put back after the engine's cast
meta_load        no private host copy per rank: the model is built on the meta device and init_inference loads each
                 rank's part from the checkpoint files (AutoTP; needs autotp where the script asks for injection)
trims            dsexp's trims around init_inference (AutoTP, tp > 1): one communicator, the head and the embedding
                 sharded, identical buffers shared
context          PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts (GPU runs)

`all` asks for every remedy that applies; one asked by name that cannot apply is refused before launch.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from dsexp.core.remedies import context_env, not_applicable, resolve


class Fixes:
    """The remedies asked for, acting through the session's observed calls (ScriptSession.call)."""

    def __init__(self, session, names: List[str]):
        self.session = session
        self.asked = list(names)
        self.active = [n for n in resolve(names) if not_applicable(n, session.spec) is None]
        self.skipped = {n: not_applicable(n, session.spec) for n in resolve(names) if n not in self.active}
        self.done: Dict[str, List[Any]] = {}
        self.engine_called = False
        self.pipelines: List[Tuple[Any, Any]] = []  # (pipeline, the device it asked for) under host_load
        self.meta = None  # the meta load's Loaded (checkpoint for the engine, finalize after it)
        self.originals = None  # restore_buffers: the buffers as recomputed right after the load
        self._pending_device = None  # host_load: the device a pipeline asked for, until it is built
        for key, value in context_env(self.active, session.runtime.get("device", "cpu")).items():
            os.environ[key] = value
            self._record("context", {key: value})

    def on(self, name: str) -> bool:
        return name in self.active

    def _record(self, name: str, what: Any) -> None:
        self.done.setdefault(name, []).append(what)

    def _not_applied(self, name: str, why: str) -> None:
        """A remedy that could not act on a call the script made: the call runs as written, the reason recorded."""
        self.skipped[name] = why

    def report(self) -> Dict[str, Any]:
        return {"asked": self.asked, "active": self.active, "not_applicable": self.skipped, "applied": self.done}

    def patches(self) -> Dict[str, Callable]:
        """Extra post-import patches (module name -> patch) the remedies need."""
        return {"deepspeed.runtime.zero.config": self._patch_zero_config} if self.on("drop_unread") else {}

    # --- around each observed call ---------------------------------------------------------------------

    def before_call(self, kind: str, fact: Dict[str, Any], fn: Callable, args: tuple, kwargs: dict):
        """(fn, args, kwargs) to call instead: the remedies' changes to the call the script made."""
        if kind == "load":
            return self._before_load(fact, fn, args, kwargs)
        if kind == "generate" and self.meta is not None and not self.engine_called and _has_meta(self.session.model):
            self.whole_again(f"{fact['api']} before any engine call")
        if kind == "move" and self.meta is not None and not self.engine_called and _on_meta(fact):
            return self._move_on_meta(fact, fn, [*args, *kwargs.values()]), args, kwargs
        if kind == "move" and self.on("host_load") and not self.engine_called and moves_to_gpu(fact):
            model = self.session.model
            self._record("host_load", f"skipped {fact['api']}({', '.join(map(str, fact.get('target') or []))})")
            return (lambda *a, **k: model), args, kwargs
        if kind == "init":
            self.engine_called = True
            return fn, args, self._before_engine(fact, args, kwargs)
        return fn, args, kwargs

    def after_call(self, kind: str, fact: Dict[str, Any], out):
        if kind == "load":
            self._after_load(fact, out)
        elif kind == "init":
            self._after_engine(fact, out)
        return out

    # --- load ------------------------------------------------------------------------------------------

    def _before_load(self, fact, fn, args, kwargs):
        kw = dict(kwargs)
        if self.on("host_load"):
            for key in ("device_map", "device"):
                if key in kw and _places_on_device(key, kw[key]):
                    asked = kw.pop(key)
                    self._record("host_load", f"{fact['api']}: {key}={asked!r} dropped (loaded on the host)")
                    if key == "device":
                        self._pending_device = asked
        if self.on("meta_load") and fact["api"].endswith("from_pretrained") and self.meta is None:
            why = meta_load_obstacle(fact.get("source"), kw)
            if why is None:
                return self._meta_from_pretrained(fact, fn, kw), args, kw
            self._not_applied("meta_load", f"{fact['api']} loaded as written: {why}")
        return fn, args, kw

    def whole_again(self, why: str) -> None:
        """The script uses the model meta_load holds on the meta device for something other than the engine (it
        saves it, it generates before sharding): the model is filled from the files on the host, as from_pretrained
        would have left it, and meta_load is recorded as not applied to that load (a later load may take it)."""
        from dsexp.rank.loading import buffers, files
        from dsexp.rank.loading.meta import tied_names

        model, folder = self.meta.model, self.meta.info.get("source")
        tied = tied_names(model)
        kept = {n: b.detach().clone() for n, b in buffers.non_persistent_buffers(model).items() if not b.is_meta}
        model.to_empty(device="cpu")
        fmt = "safetensors" if any(p.endswith(".safetensors") for p in os.listdir(folder)) else "bin"
        files.fill(model, files.checkpoint_files(folder, fmt), tied)
        buffers.restore(model, kept, "cpu")
        self.meta = None
        self.done.pop("meta_load", None)
        self._not_applied("meta_load", f"{folder}: loaded whole on the host after all: {why} needs its weights")

    def _move_on_meta(self, fact: Dict[str, Any], fn: Callable, target: list) -> Callable:
        """The script moves the model before the engine while meta_load holds it on the meta device (no data to
        copy): the device part is left to init_inference, which places each rank's part; a dtype asked for is
        applied (a cast is defined on meta)."""
        import torch

        dtype = next((t for t in target if isinstance(t, torch.dtype)), None)
        model = self.session.model
        call = f"{fact['api']}({', '.join(map(str, fact.get('target') or []))})"
        kept = f", its dtype {dtype} applied" if dtype is not None else ""
        self._record(
            "meta_load",
            f"{call} before the engine: the device move left to init_inference (the model is on the meta device "
            f"until it loads each rank's part){kept}",
        )
        return lambda *a, **k: model if dtype is None else fn(dtype)

    def _meta_from_pretrained(self, fact: Dict[str, Any], fn: Callable, kwargs: dict) -> Callable:
        """from_pretrained replaced by dsexp's meta build (parameters on meta, buffers from the constructor); where
        the meta load refuses this model (DeepSpeed could not fill it), the call as written, the reason recorded."""
        source = fact["source"]

        def load(*args, **kw):
            from dsexp.rank.loading.meta import MetaLoader

            try:
                self.meta = MetaLoader().load(self._ctx(source, kwargs), {})
            except RuntimeError as e:
                self._not_applied("meta_load", f"{fact['api']} loaded as written: {e}"[:1000])
                return fn(*args, **kw)
            self.meta.info["source"] = source
            self._record("meta_load", dict(self.meta.info))
            return self.meta.model

        return load

    def _after_load(self, fact: Dict[str, Any], out) -> None:
        if self._pending_device is not None:
            self.pipelines.append((out, self._pending_device))
            self._pending_device = None
        import torch

        model = out if isinstance(out, torch.nn.Module) else getattr(out, "model", None)
        if self.on("restore_buffers") and self.meta is None and model is not None and _local_folder(fact.get("source")):
            from dsexp.rank.loading import buffers

            ctx = self._ctx(fact.get("source"), fact.get("kwargs") or {})
            self.originals, report = buffers.after_load(model, ctx, recompute=True)
            self._record("restore_buffers", {"after_load": {k: report[k] for k in ("recomputed", "checked")}})

    # --- the engine -----------------------------------------------------------------------------------

    def _before_engine(self, fact: Dict[str, Any], args: tuple, kwargs: dict) -> dict:
        kw = dict(kwargs)
        if fact.get("engine") != "init_inference":
            return kw
        model = args[0] if args else kw.get("model")
        if self.on("autotp") and kw.get("replace_with_kernel_inject") and not fact.get("kernel_policy_layers"):
            policy = (fact.get("autotp_policy") or {}).get("policy")
            kw["replace_with_kernel_inject"] = False
            if policy:
                from dsexp.engines.init_inference.rank import resolve_policy

                kw["injection_policy"] = resolve_policy(policy, model)
            self._record("autotp", {"replace_with_kernel_inject": False, "injection_policy": policy})
            self._ensure_distributed("autotp")  # AutoTP asks DeepSpeed's comm for ranks (0.14.4: even at world size 1)
        if self.on("drop_unread") and "zero" in kw:
            kw.pop("zero")
            self._record("drop_unread", "init_inference's zero= block dropped: init_inference never reads it")
        if self.meta is not None and self.meta.checkpoint is not None and self._world() > 1:
            if kw.get("replace_with_kernel_inject"):
                raise RuntimeError(
                    "script.fix=meta_load: the script keeps kernel injection, whose checkpoint path reads .bin files "
                    "only; add autotp (or use all)"
                )
            kw["checkpoint"] = self.meta.checkpoint
            self._record("meta_load", "init_inference(checkpoint=...) loads each rank's part from the files")
        if self.on("trims") and not kw.get("replace_with_kernel_inject") and self._world() > 1:
            self._trims_before(model, kw)
        return kw

    def _trims_before(self, model, kw: dict) -> None:
        from dsexp.core.schema import TrimConfig
        from dsexp.engines.init_inference.rank import InitInference
        from dsexp.trims.dedupe_buffers.rank import HeldBuffers

        self._ensure_distributed("trims")  # the group trim needs it before init_inference would make it
        ctx = self._ctx(None, {})
        # a head tied to the input embedding: sharding the embedding's rows gave Bloom's head a vocabulary/tp
        # output (a forward with labels failed: tests/data/user_scripts/perplexity.py), so the table stays whole
        tied = _head_tied_to_embedding(model)
        ctx.spec.trim = TrimConfig(
            name="all", dedupe_buffers=True, shard_head=True, shard_embedding=not tied, world_group=True
        )
        if tied:
            self._record("trims", "shard_embedding skipped: the output head is tied to the input embedding")
        grain = getattr(kw.get("tensor_parallel"), "tp_grain_size", 64)
        self.held = HeldBuffers(model)
        self.trim_done, self.alias = InitInference._before_init(model, ctx, kw.get("checkpoint"), grain)
        self.trim_grain, self.trim_ctx = grain, ctx

    def _after_engine(self, fact: Dict[str, Any], out) -> None:
        engine = out[0] if isinstance(out, tuple) else out
        module = getattr(engine, "module", engine)
        if self.meta is not None and self.meta.finalize is not None:
            self._record("meta_load", {"after_engine": _plain(self.meta.finalize(module))})
        elif self.originals is not None:
            from dsexp.rank.loading import buffers

            device = "cuda" if self.session.on_gpu else "cpu"
            self._record("restore_buffers", {"after_engine": buffers.restore(module, self.originals, device)})
        if getattr(self, "trim_ctx", None) is not None:
            self._trims_after(module, engine)
        for pipe, device in self.pipelines:
            import torch

            pipe.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
            self._record("host_load", f"pipeline device set back to {pipe.device} after the engine")

    def _trims_after(self, module, engine) -> None:
        from dsexp.trims.dedupe_buffers.rank import dedupe_buffers
        from dsexp.trims.shard_embedding.rank import shard_embedding
        from dsexp.trims.shard_head.rank import unalias_head

        done = self.trim_done
        if self.alias:
            done["shard_head"] = unalias_head(module, self.alias, done["shard_head"])
        if "shard_embedding" not in done and self.trim_ctx.spec.trim.shard_embedding:
            done["shard_embedding"] = shard_embedding(module, engine.mp_group, self.trim_grain, "after init_inference")
        device = "cuda" if self.session.on_gpu else "cpu"
        done["dedupe_buffers"] = dedupe_buffers(module, self.held, device)
        self._record("trims", _plain(done))

    # --- helpers ---------------------------------------------------------------------------------------

    def _ensure_distributed(self, remedy: str) -> None:
        """DeepSpeed's communicator before init_inference would make it. A script that made its own torch process
        group has none yet: init_distributed wraps that group (DeepSpeed's calls fail without it)."""
        import deepspeed
        import deepspeed.comm as ds_comm
        import torch.distributed as dist

        if not ds_comm.is_initialized():
            own = dist.is_initialized()
            deepspeed.init_distributed()
            self._record(
                remedy,
                "deepspeed.init_distributed() before init_inference"
                + (" (wraps the script's own process group)" if own else ""),
            )

    def _world(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def _ctx(self, source: Optional[str], kwargs: dict):
        """A RankContext for dsexp's loaders and trims, describing the model the script loads."""
        import copy
        from pathlib import Path

        from dsexp.core.context import RankContext

        s = self.session
        spec = copy.deepcopy(s.spec)
        load = next((c for c in s.calls if c.get("kind") == "load"), {})
        source = source or load.get("source")
        kw = kwargs or load.get("kwargs") or {}
        spec.model.path, spec.model.trust_remote_code = source, bool(kw.get("trust_remote_code"))
        spec.dtype = _dtype_name(kw.get("torch_dtype") or kw.get("dtype")) or "fp32"
        spec.engine.kernel_inject = False
        device = f"cuda:{s.local_rank}" if s.on_gpu else "cpu"
        return RankContext(spec, s.rank, s.local_rank, self._world(), s.rec.path.parents[1], Path(source),
                           s.runtime, device)  # fmt: skip

    def _patch_zero_config(self, module) -> None:
        """DeepSpeedZeroConfig(...) with a field this DeepSpeed rejects: built without it, the drop recorded."""
        cls = module.DeepSpeedZeroConfig
        orig = cls.__init__
        fixes = self

        def __init__(self, *args, **data):
            rejected = [k for k in data if k not in _zero_fields(cls)]
            if rejected:
                import deepspeed

                for k in rejected:
                    data.pop(k)
                fixes._record(
                    "drop_unread",
                    f"DeepSpeedZeroConfig: {', '.join(rejected)} dropped (DeepSpeed {deepspeed.__version__} rejects "
                    "it; init_inference never reads the ZeRO block anyway)",
                )
            orig(self, *args, **data)

        cls.__init__ = __init__


def _zero_fields(cls) -> set:
    from dsexp.core.compat import config_fields

    fields = config_fields(cls)
    return set(fields) | {getattr(f, "alias", None) for f in fields.values()} - {None}


def moves_to_gpu(fact: Dict[str, Any]) -> bool:
    """Whether an observed move sends the model to a GPU: `.cuda()` (any arguments: none means the current
    device) or `.to(...)` naming one."""
    return fact.get("method") == "cuda" or _to_gpu(fact.get("target"))


def _to_gpu(targets) -> bool:
    """Whether a move / device argument names a GPU (cuda, cuda:N, an int, torch.device('cuda'))."""
    for t in targets or []:
        text = str(t)
        if "cuda" in text or (text.isdigit() and int(text) >= 0) or (isinstance(t, int) and t >= 0):
            return True
    return False


def _places_on_device(key: str, value: Any) -> bool:
    """A device_map that places the model itself (a GPU, or accelerate's "auto"/"balanced"/"sequential", which
    take every GPU there is), or a pipeline device naming a GPU."""
    if key == "device_map":
        return value not in (None, "cpu") and value != {"": "cpu"}
    return _to_gpu([value])


def _head_tied_to_embedding(model) -> bool:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)


def _has_meta(model) -> bool:
    return model is not None and any(p.is_meta for p in model.parameters())


def _on_meta(fact: Dict[str, Any]) -> bool:
    return bool((fact.get("placement_before") or {}).get("on_meta"))


def meta_load_obstacle(source: Any, kwargs: Dict[str, Any]) -> Optional[str]:
    """Why meta_load cannot replace this from_pretrained (None: it can): it needs a local folder of checkpoint
    files and a load that hands the whole model to init_inference, not one that places or shards it itself."""
    if not _local_folder(source):
        return f"{source!r} is not a local model folder (meta_load reads the checkpoint files)"
    for key in ("tp_plan", "device_map", "quantization_config", "load_in_8bit", "load_in_4bit"):
        if kwargs.get(key) not in (None, False, "cpu"):
            return f"it passes {key}={kwargs[key]!r}: transformers places the model itself, not init_inference"
    return None


def _local_folder(source: Any) -> bool:
    return isinstance(source, str) and os.path.isfile(os.path.join(source, "config.json"))


def _dtype_name(value: Any) -> Optional[str]:
    text = str(value or "").replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(text)


def _plain(v: Any) -> Any:
    from dsexp.rank.workloads.script.facts import printable

    return printable(v)
