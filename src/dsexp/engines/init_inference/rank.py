"""init_inference on a rank: `deepspeed.init_inference`, kernel injection or AutoTP with an injection policy, and the
AutoTP trims around the call (dsexp.trims: world_group, shard_embedding, shard_head).

The engine reports what DeepSpeed did, not what it was asked: module classes removed and added,
and which of the user's config fields DeepSpeed's code read during init and generate.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.compat import config_fields
from dsexp.core.config_trace import FieldReadTracer
from dsexp.core.context import RankContext
from dsexp.engines.base import INFER, effective_policy
from dsexp.engines.rank import Engine
from dsexp.trims.shard_embedding.rank import shard_embedding
from dsexp.trims.shard_head.rank import alias_head, unalias_head
from dsexp.trims.world_group.rank import preset_group


def resolve_policy(policy: Optional[Dict[str, Any]], model) -> Optional[Dict[type, tuple]]:
    """{"LayerClassName": [linear names]} -> {class: tuple}; classes are looked up in the model, never eval'd."""
    if not policy:
        return None
    classes = {type(m).__name__: type(m) for m in model.modules()}
    out = {}
    for cls_name, names in policy.items():
        if cls_name not in classes:
            raise ValueError(
                f"injection_policy names class {cls_name!r}, which is not in the model "
                f"(layer classes: {', '.join(sorted(c for c in classes if 'Layer' in c))})"
            )
        out[classes[cls_name]] = tuple(names)
    return out


def applied_policy(ctx: RankContext, model) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """(policy the engine runs with, how it was found): with engine.injection_policy=infer, dsexp's answer
    ({"policy", "source": known|deepspeed|inferred, "why", "rule", "agrees"}); else the configured one and None."""
    e = ctx.spec.engine
    policy = effective_policy(e.injection_policy, e.kernel_inject, ctx.spec.model.injection_policy)
    if policy != INFER:
        return policy, None
    from dsexp.models.policy import infer_policy

    found = infer_policy(model)
    return found["policy"], found


def zero_block(ctx: RankContext):
    """The `zero=` argument as the seed builds it (a DeepSpeedZeroConfig), or None without one."""
    z = ctx.spec.zero
    if z.stage == 0:
        return None
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = dict(z.extra)
    if z.offload == "cpu":
        fields["offload_param"] = {"device": "cpu"}
    return DeepSpeedZeroConfig(stage=z.stage, **fields)


def zero_field_names(ctx: RankContext) -> List[str]:
    """The DeepSpeedZeroConfig fields the user's zero block sets (aliases such as stage3_* mapped to field names)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    by_alias = {f.alias: name for name, f in config_fields(DeepSpeedZeroConfig).items() if getattr(f, "alias", None)}
    keys = ["stage", *ctx.spec.zero.extra] + (["offload_param"] if ctx.spec.zero.offload == "cpu" else [])
    return sorted({by_alias.get(k, k) for k in keys})


class InitInference(Engine):
    name = "init_inference"

    def apply(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        import deepspeed
        from deepspeed.inference.config import DeepSpeedInferenceConfig, DeepSpeedTPConfig
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        e = ctx.spec.engine
        kwargs: Dict[str, Any] = dict(
            tensor_parallel=DeepSpeedTPConfig(tp_size=ctx.world_size),
            dtype=ctx.torch_dtype,
            replace_with_kernel_inject=e.kernel_inject,
            max_out_tokens=e.max_out_tokens,
        )
        policy, inference = applied_policy(ctx, model)
        # DeepSpeed's own parser's policy is left for DeepSpeed to find and apply, exactly as without one
        if policy and not (inference and inference["source"] == "deepspeed"):
            kwargs["injection_policy"] = resolve_policy(policy, model)
        if e.replace_method is not None:
            kwargs["replace_method"] = e.replace_method
        if e.keep_module_on_host:
            kwargs["keep_module_on_host"] = True
        zero = zero_block(ctx)  # built here, as the seed does: DeepSpeed may reject it (a config_rejected result)
        if zero is not None:
            kwargs["zero"] = zero
        if checkpoint is not None:
            kwargs["checkpoint"] = checkpoint
        report: Dict[str, Any] = {"call": {k: _printable(v) for k, v in kwargs.items()}, "injection_policy": policy}
        if inference is not None:
            report["policy_inference"] = inference
        if e.kernel_inject:
            from dsexp.models.kernel_policy import kernel_injected_layers

            report["kernel_policy_layers"] = kernel_injected_layers(model)  # empty: injection replaces nothing
        grain = getattr(kwargs["tensor_parallel"], "tp_grain_size", 64)  # DeepSpeed 0.14 has no grain (nor VPE)
        done, alias = self._before_init(model, ctx, checkpoint, grain)
        self.tracer = FieldReadTracer([DeepSpeedInferenceConfig, DeepSpeedTPConfig, DeepSpeedZeroConfig]).start()
        with autotp_attributes_across_files(report):
            engine = deepspeed.init_inference(model, **kwargs)
        self.user_fields = sorted(k for k in kwargs if k != "dtype") + ["dtype"]
        self.zero_fields = zero_field_names(ctx) if zero is not None else []
        module = engine.module
        if alias:
            done["shard_head"] = unalias_head(module, alias, done["shard_head"])
        if ctx.spec.trim.shard_embedding and "shard_embedding" not in done:
            done["shard_embedding"] = shard_embedding(module, engine.mp_group, grain, "after init_inference")
        if done:
            report["trims"] = done
        return module, report

    @staticmethod
    def _before_init(model, ctx: RankContext, checkpoint, grain: int) -> Tuple[Dict[str, Any], Optional[str]]:
        """The trims that act before init_inference: the group DeepSpeed is handed, a VocabParallelEmbedding built
        while the weights are still on the host (or on meta, filled later by dsexp), the head's alias. Returns (what
        was done, the aliased head attribute or None)."""
        t, tp, done = ctx.spec.trim, ctx.world_size, {}
        if tp == 1:
            skip = {"skipped": "tp=1: AutoTP does not run, there is nothing to split"}
            done.update({k: dict(skip) for k in ("shard_head", "shard_embedding", "world_group") if getattr(t, k)})
            return done, None
        # DeepSpeed's checkpoint loader fills nn.Embedding only. load=sharded's model is on meta: with a
        # VocabParallelEmbedding already there, AutoTP cut its meta head on both dims ((512, 128) of a (1024, 256)
        # head at tp=2, where the split run's eager model kept (1024, 128)), so it takes the embedding after too
        embed_first = t.shard_embedding and checkpoint is None and ctx.spec.load.name != "sharded"
        if t.world_group or embed_first:
            group, info = preset_group(t.world_group, tp)
            if t.world_group:
                done["world_group"] = info
            if embed_first:
                done["shard_embedding"] = shard_embedding(model, group, grain, "before init_inference")
        alias = None
        if t.shard_head:
            alias, done["shard_head"] = alias_head(model)
        return done, alias

    def finish(self, report: Dict[str, Any]) -> Dict[str, Any]:
        tracer = getattr(self, "tracer", None)
        if tracer is None:
            return report
        tracer.stop()
        unread = [f for f in self.user_fields if not tracer.used("DeepSpeedInferenceConfig", f)]
        unread += [f"zero.{f}" for f in self.zero_fields if not tracer.used("DeepSpeedZeroConfig", f)]
        report["unread_fields"] = unread
        report["field_readers"] = {f: tracer.readers("DeepSpeedInferenceConfig", f) for f in self.user_fields}
        return report


def _printable(v: Any) -> Any:
    if hasattr(v, "model_dump"):
        return {k: _printable(x) for k, x in v.model_dump(exclude_unset=True).items()}
    if isinstance(v, dict):
        return {getattr(k, "__name__", str(k)): _printable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_printable(x) for x in v]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


ENGINE = InitInference


@contextmanager
def autotp_attributes_across_files(report: Dict[str, Any]):
    """DeepSpeed (0.19) loads an AutoTP checkpoint file by file, and sets a module's head counts (num_heads,
    hidden_size, ...) to its rank's share the first time it meets it, marking it done; a module whose weights come
    in a later file is marked while nothing in it is split yet, so its counts stay whole, and the model's own shape
    checks fail in generate (InternLM2 at 20B shapes, 10 files, tp=2: "attention weights should be of size (3, 48,
    2048, 2048), but are (3, 24, 2048, 2048)"). Those modules get their counts shared out once every file is in;
    what was done is reported (engine.autotp_attributes_resharded). DeepSpeed without this bookkeeping: nothing."""
    try:
        from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
        from deepspeed.module_inject.auto_tp import AutoTP
    except ImportError:
        yield
        return
    original = AutoTP.update_mp_params
    early: List[Tuple[Any, Any, Optional[str]]] = []

    def split_yet(module) -> bool:
        return any(hasattr(p, DS_AUTOTP_UC_META) for p in module.parameters())

    def tracking(self, child, name=None):
        first = not getattr(child, "replaced", False)
        original(self, child, name)
        if first and not split_yet(child):
            early.append((self, child, name))

    AutoTP.update_mp_params = tracking
    try:
        yield
    finally:
        AutoTP.update_mp_params = original
    redone = []
    for autotp, child, name in early:
        if split_yet(child):
            child.replaced = False
            original(autotp, child, name)
            redone.append(name)
    if redone:
        report["autotp_attributes_resharded"] = {"modules": len(redone), "first": redone[:3]}
