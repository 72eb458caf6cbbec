"""Remedies dsexp applies to a user's script through its hooks (`script.fix=[...]`), without editing it.

Filled in below; `fix_problem` refuses a remedy name dsexp does not know before anything is launched.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

FIXES: Dict[str, str] = {}


def fix_problem(fixes: List[str], spec) -> Optional[str]:
    unknown = [f for f in fixes if f != "all" and f not in FIXES]
    if unknown:
        return f"script.fix: unknown remedy {unknown[0]!r}; choose from: all, {', '.join(FIXES) or '(none yet)'}"
    return None


class Fixes:
    def __init__(self, session, names: List[str]):
        self.session, self.names = session, names

    def before_call(self, kind: str, fact: Dict[str, Any], args: tuple, kwargs: dict):
        return args, kwargs

    def after_call(self, kind: str, fact: Dict[str, Any], out):
        return out

    def report(self) -> Dict[str, Any]:
        return {"asked": self.names}
