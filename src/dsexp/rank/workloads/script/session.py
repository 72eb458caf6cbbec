"""One rank of a user's script: the phases its observed library calls open, the facts they leave, how it ended.

A phase is opened by a hook where a library call starts and closed where it returns (only the outermost observed
call: DeepSpeed moving the model inside init_inference is part of init). `start` runs from the process's creation to
the first observed call. Phases are never aligned by a barrier: a script may make a call on some ranks only.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from dsexp.rank.budget_cap import check_simulated, simulate_script_call
from dsexp.rank.probes.failure_site import failure_site
from dsexp.rank.probes.phases import PhaseRecorder

Facts = Callable[..., Dict[str, Any]]


class ScriptSession:
    def __init__(self, rec: PhaseRecorder, spec, runtime: Dict[str, Any], rank: int, local_rank: int):
        self.rec, self.spec, self.runtime = rec, spec, runtime
        self.rank, self.local_rank = rank, local_rank
        self.on_gpu = runtime.get("device") == "cuda"
        self.calls: List[Dict[str, Any]] = []
        self.events: List[Dict[str, Any]] = []  # see_memory_usage calls, caps applied
        self.depth = 0  # > 0 inside an observed call: nested observed calls are part of it
        self.implicit: Optional[str] = None  # the open `start` phase, until the first observed call
        self.last_phase: Optional[str] = None
        self.open_phase: Optional[str] = None  # the observed call's phase while it runs
        self.exit_code: Any = None
        self.finished = False
        self.finishers: List[Callable[[], Dict[str, Any]]] = []  # facts only known at the end (fields never read)
        self.fixes = None  # dsexp.rank.workloads.script.fixes.Fixes when script.fix asks for remedies
        self.model = None  # the model as the last observed call left it (loaded, moved, wrapped by an engine)
        self.logits_hooked = False  # rank 0 keeps the first generate's first-step logits

    # --- phases -----------------------------------------------------------------------------------

    def open_start(self, t0: float) -> None:
        self.implicit = self.rec.begin("start", t0=t0, align=False)

    def _close_start(self) -> None:
        if self.implicit is None:
            return
        self.rec.end(self.implicit)
        self.implicit = None
        self._attach_gpu()

    def _attach_gpu(self) -> None:
        """On a GPU run, once torch is imported: watch this rank's device (LOCAL_RANK's, as every launcher means it)
        and read the memory outside PyTorch's allocator after the CUDA context."""
        if not self.on_gpu or self.rec.cuda_index is not None or "torch" not in sys.modules:
            return
        import torch

        from dsexp.rank.probes.gpu import outside_reading

        if not torch.cuda.is_available():
            return
        from dsexp.rank.budget_cap import enforce_script

        self.rec.attach_cuda(self.local_rank)
        outside = {"context": outside_reading(self.local_rank, self.rec.nvml)}
        self.rec.annotate_phase("start", outside=outside)
        cap = enforce_script(self.spec, self.local_rank, outside)  # a budget search's run: capped as its GPU would be
        if cap:
            self.rec.note(budget=cap)

    def call(
        self,
        kind: str,
        api: str,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        before: Optional[Facts] = None,
        after: Optional[Facts] = None,
    ):
        """Run one observed library call: the outermost one is a phase of `kind`, with the facts `before(args,
        kwargs)` and `after(out, args, kwargs)` give; the remedies asked for (script.fix) act on its arguments."""
        if self.depth:
            return fn(*args, **kwargs)
        self.depth += 1
        try:
            self._close_start()
            fact: Dict[str, Any] = {"kind": kind, "api": api, "time": time.time()}
            _collect(fact, before, args, kwargs)
            if self.fixes is not None:
                fn, args, kwargs = self.fixes.before_call(kind, fact, fn, args, kwargs)
                if kind == "init":  # the call as the remedies made it (the memory model predicts this one)
                    from dsexp.rank.workloads.script.facts import printable

                    fact["called_with"] = {k: printable(v) for k, v in kwargs.items() if k != "model"}
            simulated = self.simulated_budget() if kind == "generate" else None
            key = fact["phase"] = self.last_phase = self.open_phase = self.rec.begin(kind, align=False)
            try:
                check_simulated(simulated)  # past a simulated budget: the out-of-memory error its GPU would raise
                out = fn(*args, **kwargs)
            except BaseException as e:
                self.open_phase = None
                self.rec.end(key, error=e)
                self._note_budget(key, simulated)
                fact["error"] = f"{type(e).__name__}: {e}"[:1000]
                self.note(fact)
                raise
            self.open_phase = None
            self.rec.end(key)
            self._note_budget(key, simulated)
            if self.fixes is not None:
                out = self.fixes.after_call(kind, fact, out)
            _collect(fact, after, out, args, kwargs)
            self.note(fact)
            return out
        finally:
            self.depth -= 1

    def simulated_budget(self) -> Optional[Dict[str, Any]]:
        """A CPU run under a budget: this generate call's simulated device need (dsexp.rank.budget_cap)."""
        from dsexp.core.result import RankRecord

        return simulate_script_call(self.spec, self.runtime, self.rank, RankRecord(self.rec.record).weights_held)

    def _note_budget(self, key: str, simulated: Optional[Dict[str, Any]]) -> None:
        if simulated:
            self.rec.annotate_phase(key, budget=simulated)
            self.rec.note(budget={k: simulated[k] for k in ("how", "budget_bytes", "cpu_scale")})

    def one_time(self, what: Dict[str, Any], call: Callable[[], Any]):
        """Run a cost paid once and reused after (DeepSpeed compiling an op, a checkpoint written), timed and recorded
        apart from the phase it falls in (the job leaves it out of that phase's time)."""
        phase = self.open_phase or self.after_last_phase()
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self.event({"kind": "one_time", "in_phase": phase, "seconds": time.perf_counter() - t0, **what})

    def note(self, fact: Dict[str, Any]) -> None:
        self.calls.append(fact)
        self.rec.note(script=self.summary())

    def event(self, what: Dict[str, Any]) -> None:
        self.events.append({"phase": self.last_phase, "time": time.time(), **what})
        self.rec.note(script=self.summary())

    def summary(self) -> Dict[str, Any]:
        return {
            "path": self.spec.script.path,
            "args": list(self.spec.script.args),
            "fix": list(self.spec.script.fix),
            "calls": self.calls,
            "events": self.events,
            "exit_code": self.exit_code,
            **({"fixes": self.fixes.report()} if self.fixes is not None else {}),
        }

    # --- the end ------------------------------------------------------------------------------------

    def uncaught(self, exc_type, exc, tb) -> None:
        """An exception the script did not catch (outside an observed call, or escaping one): the rank failed."""
        if self.rec.record["error"] is None:
            self.rec.note(
                error={
                    "phase": self.after_last_phase(),
                    "type": exc_type.__name__,
                    "message": str(exc)[:2000],
                    "traceback": "".join(traceback.format_exception(exc_type, exc, tb))[-4000:],
                    "time": time.time(),
                    "site": failure_site(exc),
                    "outside_calls": True,
                },
                status="failed",
            )

    def after_last_phase(self) -> str:
        """Where the script was when it failed outside an observed call: `start` before any, else after_<phase>."""
        return f"after_{self.last_phase}" if self.last_phase else "start"

    def finish(self) -> None:
        """At interpreter exit: close `start` if nothing was observed, add the facts only known now, write the
        record. A non-zero exit code with no error recorded is the rank's failure."""
        if self.finished:
            return
        self.finished = True
        if self.implicit is not None:
            self.rec.end(self.implicit)
            self.implicit = None
        for finisher in self.finishers:
            try:
                self.events.append({"kind": "final", **finisher()})
            except Exception as e:  # a probe must never change how the script ends
                self.events.append({"kind": "final", "error": repr(e)})
        code = self.exit_code
        if code not in (None, 0) and self.rec.record["error"] is None:
            self.rec.note(
                error={
                    "phase": self.after_last_phase(),
                    "type": "SystemExit",
                    "message": f"the script exited with code {code!r}",
                    "time": time.time(),
                    "outside_calls": True,
                },
                status="failed",
            )
        from dsexp.rank.probes.software import software

        self.rec.note(script=self.summary())
        self.rec.finish(software=software())


def _collect(fact: Dict[str, Any], facts: Optional[Facts], *args) -> None:
    """Add what `facts` tells about the call; a probe that fails says so in the record and changes nothing."""
    if facts is None:
        return
    try:
        fact.update(facts(*args))
    except Exception as e:
        fact.setdefault("probe_errors", []).append(f"{type(e).__name__}: {e}"[:300])
