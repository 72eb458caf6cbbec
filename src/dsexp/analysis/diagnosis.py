"""Diagnosis of one run: prediction vs measurement, in plain sentences with the numbers.

Each rule looks at one kind of evidence and returns findings (or none). A finding is a `problem`
(something the user should act on) or `info` (what happened, as expected or not). Host-memory rules
only conclude when the model is large enough to stand out of the interpreter's own memory. A run that
failed before finishing gets its failure and the host findings valid up to the failure, nothing that
compares its partial figures with a floor or with other runs.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from dsexp.analysis import measured as m
from dsexp.analysis import user_script
from dsexp.analysis.memory import workload_floor
from dsexp.core.result import JobRecord
from dsexp.core.schema import EngineConfig
from dsexp.engines import ENGINES
from dsexp.predict.weights_per_rank import Prediction
from dsexp.trims.world_group import TRAITS as WORLD_GROUP

WEIGHT_TOL = 0.02  # predicted vs measured weights: "as predicted" within 2%
UNSHARDED = 0.98  # a rank holding >= 98% of the model holds all of it
SIGNIFICANT = 256 * 2**20  # host rules need a model this large: imports during load add ~100-200 MiB per rank
FLAT = 0.95  # per-device memory "did not fall" when tp=N keeps >= 95% of the smaller tp
TRANSIENT = 0.25  # a load/init allocation this far (fraction of the model) above the weights kept
WHOLE = 0.9  # ... reaching this fraction of the model: the whole model was on the GPU


@dataclass
class Finding:
    code: str
    severity: str  # "problem" | "info"
    text: str


@dataclass
class RunFacts:
    result: Dict[str, Any]
    prediction: Optional[Prediction]
    siblings: List[Dict[str, Any]]  # results of the same configuration at other tp

    @property
    def record(self) -> JobRecord:
        return JobRecord.of(self.result)


Rule = Callable[[RunFacts], List[Finding]]


def diagnose(
    result: Dict[str, Any], prediction: Optional[Prediction], siblings: Optional[List[Dict[str, Any]]] = None
) -> List[Finding]:
    facts = RunFacts(result, prediction, [s for s in siblings or [] if m.completed(s)])
    if user_script.is_script(result):
        return script_findings(facts) + all_reduce(result)
    if m.completed(result):
        found = [f for rule in RULES for f in rule(facts)]
    else:
        # after init the placement is whole (the census, the engine report): it is diagnosed as for a completed run
        after_init = [weights_vs_model, policy_found] if m.init_recorded(result) else []
        found = failed(facts) + [
            Finding(f.code, f.severity, f"{f.text} (up to the failure)")
            for rule in [*after_init, host_copies]
            for f in rule(facts)
        ]
    return sorted(found + all_reduce(result), key=lambda f: f.severity != "problem")


def all_reduce(result: Dict[str, Any]) -> List[Finding]:
    """One line where the ranks found DeepSpeed's CPU shared-memory all-reduce unusable on their CPU (no avx512bw):
    what ran instead and why (dsexp.rank.shm_fallback)."""
    got = result.get("all_reduce")
    if not got:
        return []
    ds = f"DeepSpeed {got.get('deepspeed')}"
    if got.get("all_reduce") == "gloo":
        was = (got.get("local_size") or {}).get("was")
        said = f"all-reduce on gloo, not {ds}'s shared memory: {got['why']} (LOCAL_SIZE=1 in the ranks, was {was})"
    else:
        said = f"all-reduce: {got.get('all_reduce')}; {got.get('why')} ({ds})"
    return [Finding("all_reduce", "info", said)]


def script_findings(f: RunFacts) -> List[Finding]:
    """A user's script: how it failed, the causes its facts show (each with its fix), what it called (its arguments,
    where the parameters were after each call), and the measured weights per rank against the memory model's
    prediction from the call it made."""
    causes = [Finding(c["code"], "problem", f"{c['text']}. Fix: {c['fix']}") for c in user_script.causes(f.result)]
    found = failed(f) + causes
    did = user_script.what_it_did(f.result)
    if did:
        found.append(Finding("script_calls", "info", f"what the script did on rank 0: {did}"))
    if m.init_recorded(f.result):
        found += weights_vs_model(f)
    if m.completed(f.result):
        found += scaling_with_tp(f)
    return sorted(found, key=lambda x: x.severity != "problem")


def text(findings: List[Finding]) -> str:
    return " ".join(f.text.rstrip(".") + "." for f in findings)


# --- rules ---------------------------------------------------------------------------------------


def failed(f: RunFacts) -> List[Finding]:
    fail = f.record.failure
    if f.record.ok or not fail or f.record.cause == "incorrect_output":
        return []
    where = " ".join(
        x
        for x in (
            f"on rank {fail['rank']}" if fail.get("rank") is not None else "",
            f"in the {fail['phase']} phase" if fail.get("phase") else "",
        )
        if x
    )
    msg = str(fail.get("message") or "").strip().splitlines()
    first = (msg[0] if msg else "")[: 1000 if fail.get("illegal_instruction") else 240]  # SIGILL: its fix too
    return [
        Finding(
            "failed",
            "problem",
            f"the run failed ({fail.get('cause')}) {where}: {first}{_site_text(fail.get('site'))}".replace("  ", " ")
            + _policy_advice(f, str(fail.get("message") or "")),
        )
    ]


def _site_text(site: Optional[Dict[str, Any]]) -> str:
    """Where in the model the error was raised (dsexp.rank.probes.failure_site), for the sentence."""
    if not site or not site.get("module"):
        return ""
    inside = f" inside {site['parent_class']}" if site.get("parent_class") else ""
    code = f", {site['code']}" if site.get("code") else ""
    return f"; raised in module {site['module']} ({site.get('class')}{inside}{code})"


_NO_POLICY = ("Not able to determine model policy", "AutoTP not supported for model")


def _policy_advice(f: RunFacts, message: str) -> str:
    """DeepSpeed found no AutoTP policy: the exact one to pass (what engine.injection_policy=infer derives)."""
    if not any(s in message for s in _NO_POLICY):
        return ""
    found = (f.prediction.policy if f.prediction else None) or {}
    if not found.get("policy"):
        return (
            "; dsexp could not derive a policy either: pass "
            "engine.injection_policy={LayerClass: [row-parallel linears]}"
        )
    from dsexp.models.policy import override_text

    return (
        f"; pass the row-parallel linears AutoTP needs: '{override_text(found['policy'])}' "
        f"(or engine.injection_policy=infer; {found.get('source')}: {found.get('why')})"
    )


def policy_found(f: RunFacts) -> List[Finding]:
    """How engine.injection_policy=infer found the AutoTP policy the run used."""
    inf = f.record.engine.get("policy_inference")
    if not inf:
        return []
    if not inf.get("policy"):
        return [
            Finding("policy_inferred", "problem", f"engine.injection_policy=infer found no policy: {inf.get('why')}")
        ]
    pol = "; ".join(f"{cls}: {', '.join(names)}" for cls, names in sorted(inf["policy"].items()))
    check = ""
    if inf.get("source") != "inferred" and inf.get("rule"):
        check = (
            "; the structural rule derives the same"
            if inf.get("agrees")
            else (
                "; the structural rule would derive "
                + "; ".join(f"{c}: {', '.join(n)}" for c, n in sorted(inf["rule"].items()))
            )
        )
    return [Finding("policy_inferred", "info", f"AutoTP policy ({inf.get('source')}) {pol}: {inf.get('why')}{check}")]


def incorrect_output(f: RunFacts) -> List[Finding]:
    c = f.record.correctness
    if not c or c.get("passed"):
        return []
    err, tol = c.get("logits_rel_err"), c.get("tolerance")
    detail = (
        f"first-step logits rel. L2 error {err:.3g} > tolerance {tol:.3g}"
        if err is not None and tol
        else c.get("message") or "no comparable logits"
    )
    agree = c.get("token_agreement")
    tokens = f"; greedy tokens agree {agree:.0%}" if agree is not None else ""
    before, after = m.buffer_bytes(f.result, "load"), m.buffer_bytes(f.result, "init")
    cast = ""
    if before and after is not None and after < before:
        dtype = f.record.config.get("dtype")
        cast = (
            f"; the model's buffers shrank from {m.human(before)} to {m.human(after)} at init: the engine cast "
            f"them (rotary inv_freq included) to {dtype}, which the tp=1 reference does not"
        )
    return [
        Finding("incorrect_output", "problem", f"outputs differ from tp=1 beyond tolerance: {detail}{tokens}{cast}")
    ]


def left_on_meta(f: RunFacts) -> List[Finding]:
    names = m.on_meta(f.result)
    if not names:
        return []
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return [Finding("on_meta", "problem", f"{len(names)} parameters were left on the meta device ({shown})")]


def weights_vs_model(f: RunFacts) -> List[Finding]:
    p, w = f.prediction, m.weights_per_rank(f.result)
    if p is not None and not w:  # no census: the engine's own report of the resident fraction, if it has one
        w = [int(x * p.model_bytes) for x in _fractions(f.record.engine.get("weight_fraction"))]
    if p is None or not w or not p.model_bytes:
        return []
    tp, dev, full = p.tp, m.device_word(f.result), p.model_bytes
    meas, pred = max(w), p.weights_max
    frac = meas / full
    if tp > 1 and frac >= UNSHARDED:
        return [_nothing_sharded(f, p, meas, frac, dev)]
    if abs(meas - pred) <= WEIGHT_TOL * pred:
        rep = p.replicated()
        tail = ""
        if tp > 1 and rep:
            tail = "; replicated on every rank: " + ", ".join(f"{n} {m.human(b)}" for n, b in list(rep.items())[:4])
        copies = [pl for pl in p.placements if pl.copy]
        if tp > 1 and copies:
            tail += "; the head is tied to the embedding: " + ", ".join(
                f"{pl.how} keeps {pl.name} {m.human(max(pl.local))} per rank on top of the whole embedding"
                for pl in copies
            )
        return [
            Finding(
                "weights_as_predicted",
                "info",
                f"weights on each {dev} = {m.human(meas)} = {frac:.0%} of the model at tp={tp}, as predicted "
                f"({m.human(pred)}, {(meas - pred) / pred:+.1%}){tail}",
            )
        ]
    return [
        Finding(
            "weights_differ",
            "problem",
            f"weights on each {dev} = {m.human(meas)} ({frac:.0%} of the model) at tp={tp}, but the memory "
            f"model predicts {m.human(pred)} ({pred / full:.0%}), {(meas - pred) / pred:+.1%}"
            + _differences(f.result, p)
            + _other_transformers(f.result),
        )
    ]


def _other_transformers(result: Dict[str, Any]) -> str:
    """Where the ranks ran another transformers than the one the memory model builds the model with (a stack):
    modeling code that moved between releases (which module holds the rotary tables, for one) is not modelled."""
    from importlib.metadata import version

    ran = JobRecord.of(result).versions.get("transformers")
    here = version("transformers")
    if not ran or ran == here:
        return ""
    return (
        f" (the ranks ran transformers {ran}, the memory model builds the model with {here}, this environment's: "
        f"modeling code that differs between the two is not modelled)"
    )


def _fractions(value: Any) -> List[float]:
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [float(v) for v in value.values() if isinstance(v, (int, float))]
    return []


def _nothing_sharded(f: RunFacts, p: Prediction, meas: int, frac: float, dev: str) -> Finding:
    mods = f.record.engine.get("modules") or {}
    why = " (no module was replaced)" if mods and not mods.get("removed") else ""
    if p.sharded:
        expect = f"; the memory model expected {m.human(p.weights_max)} ({p.fraction:.0%})" + _differences(f.result, p)
    else:
        expect = "; as the memory model predicts" + (f": {p.notes[0]}" if p.notes else "")
    return Finding(
        "nothing_sharded",
        "problem",
        f"weights on each {dev} = {frac:.0%} of the model ({m.human(meas)}) at tp={p.tp}: "
        f"nothing was sharded{why}{expect}",
    )


def _differences(result: Dict[str, Any], p: Prediction) -> str:
    """Where measured placement departs from the model: module replacements, replicated tensors."""
    out = []
    mods = JobRecord.of(result).engine.get("modules")
    if mods is not None:
        for cls in sorted(set(p.modules.get("added", {})) | set(mods.get("added", {}))):
            want, got = p.modules.get("added", {}).get(cls, 0), mods.get("added", {}).get(cls, 0)
            if want != got:
                out.append(f"{got} {cls} modules instead of {want}")
    rep = JobRecord.of(result).engine.get("replicated")
    if isinstance(rep, dict):
        predicted = {pl.name for pl in p.placements if pl.how == "replicated"}
        extra = sorted(n for n in rep if n not in predicted)
        if extra:
            out.append("replicated although the model shards them: " + ", ".join(extra[:5]))
    tensors = tensor_differences(result, p)
    if tensors:
        out.append(
            "tensors (predicted -> measured per rank): "
            + ", ".join(
                f"{name}{f' (x{n})' if n > 1 else ''} on rank {r} {m.human(want)} -> {m.human(got)}"
                for name, n, r, want, got in tensors
            )
        )
    return ("; differences: " + "; ".join(out)) if out else ""


TOP_TENSORS = 6


def tensor_differences(
    result: Dict[str, Any], p: Prediction, top: int = TOP_TENSORS
) -> List[Tuple[str, int, int, int, int]]:
    """Where the per-tensor census departs from the prediction: (name with layer numbers as *, how many tensors,
    rank, predicted bytes, measured bytes), summed over the layers, the largest differences first (on any rank)."""
    census = m.tensors_per_rank(result)
    if not any(census):
        return []
    rows: Dict[Tuple[str, int], List[int]] = defaultdict(lambda: [0, 0, 0])
    for r, measured in enumerate(census[: p.tp]):
        if not measured:
            continue
        predicted = {pl.name: pl.local[r] for pl in p.placements}
        for name in set(predicted) | set(measured):
            want, got = predicted.get(name, 0), measured.get(name, 0)
            if want != got:
                acc = rows[(re.sub(r"\.\d+\.", ".*.", name), r)]
                acc[0] += 1
                acc[1] += want
                acc[2] += got
    # ties by name and rank: the rows come from sets, whose order changes from one process to the next
    ranked = sorted(rows.items(), key=lambda kv: (-abs(kv[1][2] - kv[1][1]), kv[0]))
    out, seen = [], set()
    for (name, r), (n, want, got) in ranked:
        if name in seen:  # one line per tensor name: its worst rank
            continue
        seen.add(name)
        out.append((name, n, r, want, got))
    return out[:top]


def unread_fields(f: RunFacts) -> List[Finding]:
    unread = f.record.engine.get("unread_fields") or []
    zero = [u for u in unread if u == "zero" or u.startswith("zero.")]
    other = [u for u in unread if u not in zero]
    engine = (f.record.config.get("engine") or {}).get("name", "the engine")
    out = []
    if zero:
        out.append(
            Finding(
                "zero_unread",
                "problem",
                f"ZeRO settings were passed to {engine} and never read ({', '.join(zero)}): they had no effect",
            )
        )
    if other:
        out.append(Finding("fields_unread", "info", f"accepted but never read by DeepSpeed: {', '.join(other)}"))
    return out


def host_copies(f: RunFacts) -> List[Finding]:
    p, growth = f.prediction, m.load_growth(f.result, "anon")
    if p is None or not growth or p.model_bytes < SIGNIFICANT:
        return []
    # beyond the TP slices a CPU rank legitimately keeps on its host
    full, per_rank = p.model_bytes, max(0, sorted(growth)[len(growth) // 2] - max(p.host.kept))
    s = p.strategy
    if per_rank >= 0.8 * full:
        reason = (
            f"dtype conversion {s.conversion}"
            if s.conversion
            else ".bin checkpoint"
            if s.fmt == "bin"
            else "no conversion was configured"
        )
        node = m.node_growth(f.result)
        node_txt = (
            (
                f"; the machine's used memory rose by {m.human(node)} during the run ({node / full:.1f} models, "
                f"other processes included)"
            )
            if node
            else ""
        )
        return [
            Finding(
                "host_private_copy",
                "problem",
                f"host memory grew by one model per rank ({m.human(per_rank)} private per rank beyond its "
                f"own slices, the model is "
                f"{m.human(full)}): each rank made a private copy while loading ({reason}){node_txt}",
            )
        ]
    if per_rank <= 0.3 * full:
        return [
            Finding(
                "host_shared",
                "info",
                f"private host memory per rank grew by only {m.human(per_rank)} while loading "
                f"({per_rank / full:.0%} of the model): {p.host.how}",
            )
        ]
    return []


def scaling_with_tp(f: RunFacts) -> List[Finding]:
    """Compared with the same configuration at the next smaller tp that was measured (correct or not)."""
    tp = f.record.config.get("tp") or 1
    smaller = [s for s in f.siblings if m.per_device_gib(s) is not None and (s.get("config") or {}).get("tp", 1) < tp]
    if m.per_device_gib(f.result) is None or not smaller:
        return []
    prev = max(smaller, key=lambda s: s["config"]["tp"])
    ptp, out = prev["config"]["tp"], []
    a, b = m.per_device_gib(prev), m.per_device_gib(f.result)
    what = "per-GPU peak" if m.on_gpu(f.result) else "device-resident weights per rank"
    if a and b is not None:
        ha, hb = m.human(a * m.GIB), m.human(b * m.GIB)
        if b >= FLAT * a:
            out.append(
                Finding("flat_with_tp", "problem", f"{what} did not fall from tp={ptp} to tp={tp} ({ha} -> {hb})")
            )
        else:
            out.append(
                Finding("falls_with_tp", "info", f"{what} fell from {ha} at tp={ptp} to {hb} ({b / a - 1:+.0%})")
            )
    na, nb = m.headline(prev, "node_host_peak_gib"), m.headline(f.result, "node_host_peak_gib")
    full = f.prediction.model_bytes if f.prediction else 0
    if na is not None and nb is not None and full >= SIGNIFICANT:
        per_added = (nb - na) * m.GIB / (tp - ptp)
        if per_added >= 0.8 * full:
            out.append(
                Finding(
                    "host_grows_per_rank",
                    "problem",
                    f"node host memory grew by {(nb - na):.3g} GiB from tp={ptp} to tp={tp}: about "
                    f"{per_added / full:.1f} model(s) per added rank",
                )
            )
    return out


def floor_terms(floor: Dict[str, Any]) -> str:
    """What the per-GPU floor adds up (analysis.memory.workload_floor), for a sentence: the weights' reserve, each term
    above them the capacity model predicts at the run's largest point, and what lives outside PyTorch's allocator."""
    names = {"weights": "weights' reserve", "outside": "outside PyTorch's allocator"}
    terms = floor["terms"]
    return " + ".join(f"{names.get(k, k.replace('_', ' '))} {m.human(v)}" for k, v in terms.items())


def gpu_overhead(f: RunFacts) -> List[Finding]:
    p = f.prediction
    peak = m.headline(f.result, "gpu_peak_gib")
    floor = workload_floor(f.result, p) if p is not None else None
    if floor is None or peak is None:
        return []
    return [
        Finding(
            "gpu_floor",
            "info",
            f"per-GPU peak {peak:.2f} GiB vs floor {floor['bytes'] / m.GIB:.2f} GiB at batch {floor['batch']} "
            f"({floor_terms(floor)}; outside: CUDA context, communicator, workspaces): "
            f"{(peak * m.GIB - floor['bytes']) / m.GIB:+.2f} GiB ({peak * m.GIB / floor['bytes'] - 1:+.1%}) "
            "of allocator cache and what the model does not count",
        )
    ]


def init_transient(f: RunFacts) -> List[Finding]:
    """A load/init allocation peak far above the weights kept: the model passed through the GPU before being cut."""
    p, w = f.prediction, m.weights_per_rank(f.result)
    if p is None or not w or not p.model_bytes:
        return []
    kept, full = max(w), p.model_bytes
    worst = max(((ph, m.gpu_max(f.result, ph, "gpu_alloc_peak") or 0) for ph in ("load", "init")), key=lambda x: x[1])
    phase, peak = worst
    if peak - kept < TRANSIENT * full:
        return []
    reserved, cached = m.gpu_max(f.result, phase, "gpu_reserved_peak"), m.gpu_max(f.result, phase, "gpu_reserved")
    what = (
        f"the whole model ({m.human(full)}) was on the GPU"
        if peak >= WHOLE * full
        else f"{peak / full:.0%} of the model ({m.human(full)}) was on the GPU at once"
    )
    kept_cache = (
        f"; PyTorch kept {m.human(cached)} reserved after it (cached, not returned to the device), so the "
        f"per-GPU peak is {m.headline(f.result, 'gpu_peak_gib'):.2f} GiB"
        if cached and reserved and cached >= WHOLE * reserved and m.headline(f.result, "gpu_peak_gib")
        else ""
    )
    return [
        Finding(
            "init_transient",
            "problem",
            f"{phase} phase peak = {m.human(peak)} allocated ({m.human(reserved)} reserved) against "
            f"{m.human(kept)} of weights kept: {what} before being partitioned{kept_cache}",
        )
    ]


OWN_GROUP = 64 * 2**20  # load + init growing the memory outside the allocator by this much: a communicator


def outside_allocator(f: RunFacts) -> List[Finding]:
    """Where the device memory outside PyTorch's allocator went (GPU runs with per-process NVML figures)."""
    parts = m.outside_parts(f.result)
    if parts is None:
        return []

    def h(key: str) -> str:
        return "none measured" if parts.get(key) is None else m.human(parts[key])

    out = [
        Finding(
            "outside_allocator",
            "info",
            f"outside PyTorch's allocator on rank {parts['rank']}: CUDA context {h('context')}, NCCL communicator "
            f"(first all_reduce) {h('communicator')}, load + init {h('engine')} (the engine's own process groups, "
            f"kernels), generate {h('generate')} (cuBLAS workspaces, kernels, connections made on first use), "
            f"device reserve {h('device_reserve')} (not this process): {m.human(parts['outside'])}; the per-GPU peak "
            f"{h('nvml_peak')} = allocator peak {m.human(parts['allocator_peak'])} + these + {h('unexplained')} "
            "unexplained",
        )
    ]
    cfg = f.record.config
    eng, trim = cfg.get("engine") or {}, cfg.get("trim") or {}
    if (
        int(cfg.get("tp") or 1) > 1
        and WORLD_GROUP.applies_to(ENGINES.get(eng.get("name", EngineConfig.name)), bool(eng.get("kernel_inject")))
        and not trim.get(WORLD_GROUP.key)
        and (parts.get("engine") or 0) >= OWN_GROUP
    ):
        out.append(
            Finding(
                "own_communicator",
                "problem",
                f"load + init added {h('engine')} outside the allocator: DeepSpeed's inference engine creates a "
                "tensor-parallel group of its own (a second NCCL communicator) even when tp is the world size; "
                "trim.world_group=true hands it the world group instead",
            )
        )
    return out


def trims_applied(f: RunFacts) -> List[Finding]:
    """What each requested trim did on rank 0 (engine.trims), in bytes per rank."""
    done = f.record.engine.get("trims") or {}
    items = []
    for key in ("shard_head", "shard_embedding", "dedupe_buffers", "world_group"):
        t = done.get(key)
        if not t:
            continue
        if t.get("skipped"):
            items.append(f"{key}: skipped ({t['skipped']})")
        elif key == "world_group":
            items.append(f"world_group: AutoTP on the {t.get('group')}")
        elif key == "dedupe_buffers":
            items.append(
                f"dedupe_buffers: {t.get('buffers')} non-persistent buffers -> {t.get('distinct_after')} distinct, "
                f"{m.human(t.get('bytes_before'))} -> {m.human(t.get('bytes_after'))}"
            )
        else:
            items.append(
                f"{key}: {t.get('module')} -> {t.get('replaced_by')}"
                + (f" ({t['when']})" if t.get("when") else "")
                + f", {m.human(t.get('bytes_before'))} -> {m.human(t.get('bytes_after'))}"
            )
    cut = done.get("last_logits")
    if cut:
        items.append(
            f"last_logits: the head ({cut['head']}) given the last position only in {cut['calls_cut']} calls"
            + (" (none: the model's code already gives it the last only)" if not cut["calls_cut"] else "")
            if cut.get("applied")
            else f"last_logits: not applied ({cut.get('why')})"
        )
    if "env" in done:
        items.append("env: " + ", ".join(f"{k}={v}" for k, v in done["env"].items()))
    return [Finding("trims", "info", "trims on rank 0: " + "; ".join(items))] if items else []


def predicted_error(f: RunFacts) -> List[Finding]:
    p = f.prediction
    if p is None or not p.error:
        return []
    return [Finding("predicted_refusal", "info", f"the memory model expects the engine to refuse this: {p.error}")]


RULES: List[Rule] = [
    failed,
    policy_found,
    incorrect_output,
    left_on_meta,
    weights_vs_model,
    unread_fields,
    host_copies,
    scaling_with_tp,
    init_transient,
    gpu_overhead,
    outside_allocator,
    trims_applied,
    predicted_error,
]
