"""The hooks: patch, as each library is imported, the calls whose phases and facts the script workload records.

| module imported                          | patched                                           | phase    |
|------------------------------------------|---------------------------------------------------|----------|
| transformers.modeling_utils              | PreTrainedModel.from_pretrained, .to, .cuda       | load, move |
| transformers.models.auto.auto_factory    | _BaseAutoModelClass.from_pretrained (any Auto*)   | load     |
| transformers.pipelines                   | pipeline(...)                                     | load     |
| transformers.generation.utils            | GenerationMixin.generate (and so remote `chat`)   | generate |
| deepspeed                                | init_inference, initialize                        | init     |
| deepspeed.runtime.utils                  | see_memory_usage (an event: peaks read first)     | -        |
| deepspeed.ops.op_builder.builder         | OpBuilder.jit_load (a one-time cost: an op built) | -        |
| transformers.modeling_utils              | save_pretrained (a one-time cost: files written)  | -        |
| torch.distributed.distributed_c10d       | ranks sharing a GPU: every group is gloo          | -        |

A post-import hook on sys.meta_path wraps the loader of exactly these modules, so the patch lands before any other
module can `from x import f` the unpatched function. Facts are plain data (dsexp.rank.workloads.script.facts).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Callable, Dict

import dsexp.rank.workloads.script.facts as facts
from dsexp.rank.workloads.script.session import ScriptSession


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, patch: Callable):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.patch(module)
        except Exception as e:  # never break the import the script asked for
            print(f"dsexp: could not hook {module.__name__}: {type(e).__name__}: {e}", file=sys.stderr)


class PostImportHooks(importlib.abc.MetaPathFinder):
    """Finds the spec with the other finders, then wraps its loader with the module's patch."""

    def __init__(self, patches: Dict[str, Callable]):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, self.patches[name])
                return spec
        return None


def install(session: ScriptSession, shared_gpu: bool) -> None:
    patches: Dict[str, Callable] = {
        "transformers.modeling_utils": lambda m: _patch_pretrained(m, session),
        "transformers.models.auto.auto_factory": lambda m: _patch_auto(m, session),
        "transformers.pipelines": lambda m: _patch_pipeline(m, session),
        "transformers.generation.utils": lambda m: _patch_generate(m, session),
        "deepspeed": lambda m: _patch_deepspeed(m, session),
        "deepspeed.runtime.utils": lambda m: _patch_see_memory(m, session),
        "deepspeed.ops.op_builder.builder": lambda m: _patch_op_builder(m, session),
    }
    if session.fixes is not None:
        patches.update(session.fixes.patches())
    if shared_gpu:
        from dsexp.rank.shared_gpu import force_gloo

        patches["torch.distributed.distributed_c10d"] = lambda m: force_gloo()
    for name, patch in patches.items():  # already imported (another sitecustomize): patch now
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, PostImportHooks(patches))


def _observed_classmethod(cls, name: str, kind: str, session: ScriptSession, before, after) -> None:
    orig = cls.__dict__[name].__func__

    @functools.wraps(orig)
    def hooked(klass, *args, **kwargs):
        call = lambda *a, **k: orig(klass, *a, **k)  # noqa: E731
        return session.call(kind, f"{klass.__name__}.{name}", call, args, kwargs, before, after)

    setattr(cls, name, classmethod(hooked))


def _observed_method(cls, name: str, kind: str, session: ScriptSession, before, after) -> None:
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def hooked(self, *args, **kwargs):
        call = lambda *a, **k: orig(self, *a, **k)  # noqa: E731
        return session.call(
            kind, f"{type(self).__name__}.{name}", call, args, kwargs, _bound(before, self), _bound(after, self)
        )

    setattr(cls, name, hooked)


def _bound(facts_fn, obj):
    return None if facts_fn is None else functools.partial(facts_fn, obj)


def _observed_function(module, name: str, kind: str, session: ScriptSession, before, after) -> None:
    orig = getattr(module, name)

    @functools.wraps(orig)
    def hooked(*args, **kwargs):
        return session.call(kind, f"{module.__name__}.{name}", orig, args, kwargs, before, after)

    setattr(module, name, hooked)


def _patch_pretrained(m, session: ScriptSession) -> None:
    cls = m.PreTrainedModel
    _observed_classmethod(cls, "from_pretrained", "load", session, facts.load_before, facts.load_after(session))
    for name in ("to", "cuda"):
        _observed_method(cls, name, "move", session, facts.move_before(name), facts.move_after(session))
    _patch_save(cls, session)


def _patch_save(cls, session: ScriptSession) -> None:
    """save_pretrained: a checkpoint written, a one-time cost (the folder and its bytes recorded)."""
    orig = cls.save_pretrained

    @functools.wraps(orig)
    def save_pretrained(self, save_directory, *args, **kwargs):
        fixes = session.fixes
        if fixes is not None and fixes.meta is not None and fixes.meta.model is self and not fixes.engine_called:
            fixes.whole_again(f"{type(self).__name__}.save_pretrained({str(save_directory)!r})")
        what = {"what": "checkpoint_written", "name": str(save_directory)}
        out = session.one_time(what, lambda: orig(self, save_directory, *args, **kwargs))
        session.events[-1]["bytes"] = facts.folder_bytes(save_directory)
        return out

    cls.save_pretrained = save_pretrained


def _patch_op_builder(m, session: ScriptSession) -> None:
    """OpBuilder.jit_load: DeepSpeed compiling (or loading its cached build of) an op, a one-time cost."""
    orig = m.OpBuilder.jit_load

    @functools.wraps(orig)
    def jit_load(self, *args, **kwargs):
        what = {"what": "op_build", "name": self.name, "cached": facts.op_cached(self.name)}
        return session.one_time(what, lambda: orig(self, *args, **kwargs))

    m.OpBuilder.jit_load = jit_load


def _patch_auto(m, session: ScriptSession) -> None:
    cls = m._BaseAutoModelClass
    _observed_classmethod(cls, "from_pretrained", "load", session, facts.load_before, facts.load_after(session))


def _patch_pipeline(m, session: ScriptSession) -> None:
    _observed_function(m, "pipeline", "load", session, facts.pipeline_before, facts.load_after(session))


def _patch_generate(m, session: ScriptSession) -> None:
    before, after = facts.generate_before(session), facts.generate_after
    _observed_method(m.GenerationMixin, "generate", "generate", session, before, after)


def _patch_deepspeed(m, session: ScriptSession) -> None:
    _observed_function(m, "init_inference", "init", session, facts.init_before(session), facts.init_after(session))
    _observed_function(m, "initialize", "init", session, facts.initialize_before, facts.init_after(session))


def _patch_see_memory(m, session: ScriptSession) -> None:
    orig = m.see_memory_usage

    @functools.wraps(orig)
    def see_memory_usage(message, force=False, *args, **kwargs):
        seen = facts.torch_peaks(session)  # before DeepSpeed resets them
        printed = facts.tee_output(lambda: orig(message, force, *args, **kwargs))
        session.event({"kind": "see_memory_usage", "message": str(message), "force": bool(force), **seen, **printed})
        if printed.get("printed") and session.last_phase:  # rank 0's figures, as dsexp's own phases record them
            session.rec.annotate_phase(session.last_phase, see_memory_usage={**printed, "message": str(message)})
        return None

    m.see_memory_usage = see_memory_usage
