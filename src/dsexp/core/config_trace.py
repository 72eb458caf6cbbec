"""Which fields of DeepSpeed's pydantic config objects are actually read, and by which source file.

Accepting a field is not using it: `init_inference` validates a `zero=` block and never looks at it
again. Patching `__getattribute__` on the config classes for the duration of init + generate turns
that from a claim into a measurement. Reads from pydantic itself or from the config modules'
validators do not count as use.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Set, Tuple

from dsexp.core.compat import config_fields

_NOT_USE = (
    "/pydantic/",
    "/pydantic_core/",
    "deepspeed/runtime/config_utils.py",
    "deepspeed/inference/config.py",
    "deepspeed/runtime/zero/config.py",
    "dsexp/rank/probes/config_trace.py",
)


class FieldReadTracer:
    def __init__(self, classes: Iterable[type]):
        self.classes = list(classes)
        self.reads: Dict[Tuple[str, str], Set[str]] = defaultdict(set)
        self._saved: List[Tuple[type, object]] = []

    def start(self) -> "FieldReadTracer":
        for cls in self.classes:
            fields = set(config_fields(cls))
            orig = cls.__getattribute__
            self._saved.append((cls, cls.__dict__.get("__getattribute__")))

            def traced(obj, name, _orig=orig, _fields=fields, _cls=cls.__name__, _reads=self.reads):
                if name in _fields:
                    _reads[(_cls, name)].add(sys._getframe(1).f_code.co_filename)
                return _orig(obj, name)

            cls.__getattribute__ = traced
        return self

    def stop(self) -> None:
        for cls, saved in reversed(self._saved):
            if saved is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = saved
        self._saved.clear()

    def __enter__(self) -> "FieldReadTracer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def used(self, cls_name: str, field: str) -> bool:
        files = self.reads.get((cls_name, field), set())
        return any(not any(tag in f.replace("\\", "/") for tag in _NOT_USE) for f in files)

    def readers(self, cls_name: str, field: str) -> List[str]:
        return sorted(
            f
            for f in self.reads.get((cls_name, field), set())
            if not any(tag in f.replace("\\", "/") for tag in _NOT_USE)
        )
