"""Typed views of what a job wrote: its result.json (`JobRecord`), each rank's record in it (`RankRecord`) and each
phase of a rank (`PhaseRecord`). Analysis and the report read these instead of nested dicts and phase strings.

The views wrap the JSON as written and tolerate every missing field (failed jobs, ranks that died before their
first record, results of an older or newer schema, runs rebuilt from MLflow params without rank records): a
missing mapping is empty, a missing figure is None, a missing phase is `PhaseRecord.EMPTY`. Writing stays with
`core.records` (rank records, aggregation); these classes only read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

from dsexp.core.records import Phase, node_shared, phase_kind, speed_representative


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of one rank: the snapshot at its end (`host`, `gpu`), its peaks, the weights census."""

    key: str
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    EMPTY = None  # set below: the phase a rank did not record

    @property
    def kind(self) -> str:
        """ "generate_2" -> "generate"."""
        return phase_kind(self.key)

    @property
    def recorded(self) -> bool:
        return bool(self.raw)

    @property
    def partial(self) -> bool:
        """Rebuilt from the rank's last heartbeat: the rank was in this phase when it stopped."""
        return bool(self.raw.get("partial"))

    @property
    def wall_s(self) -> Optional[float]:
        return self.raw.get("wall_s")

    @property
    def host(self) -> Mapping[str, int]:
        return _mapping(self.raw.get("host"))

    @property
    def gpu(self) -> Mapping[str, int]:
        return _mapping(self.raw.get("gpu"))

    @property
    def peaks(self) -> Mapping[str, int]:
        return _mapping(self.raw.get("peaks"))

    @property
    def point(self) -> Mapping[str, Any]:
        """A workload point's figures (batch, prompt length, prefill/decode peaks, latency); empty elsewhere."""
        return _mapping(self.raw.get("point"))

    @property
    def outside(self) -> Mapping[str, Mapping[str, int]]:
        """GPU readings taken within `start` (after the CUDA context, after the first collective)."""
        return _mapping(self.raw.get("outside"))

    @property
    def weights_device(self) -> Optional[int]:
        """Parameter + buffer bytes on the rank's compute device at the phase's end."""
        w = self.raw.get("weights_device")
        return None if w is None else int(w)

    @property
    def census(self) -> Mapping[str, Any]:
        """The weights census: bytes by device and dtype, buffer bytes, tensors left on meta."""
        return _mapping(self.raw.get("weights"))

    @property
    def tensors(self) -> Dict[str, int]:
        """{tensor name: local bytes on the device} (the per-tensor census; empty where not recorded)."""
        return dict(_mapping(self.raw.get("tensors")))

    @property
    def see_memory_usage(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("see_memory_usage"))

    def peak(self, key: str) -> Optional[int]:
        """A peak over the phase, falling back to the snapshot at its end where no peak was sampled:
        peak("nvml_process_used") reads peaks.nvml_process_used_peak, else gpu.nvml_process_used."""
        v = self.peaks.get(f"{key}_peak")
        return v if v is not None else self.gpu.get(key)


PhaseRecord.EMPTY = PhaseRecord("")


@dataclass(frozen=True)
class RankRecord:
    """One rank's record: its phases in the order it ran them, its error, where it ran."""

    raw: Mapping[str, Any] = field(repr=False)

    @property
    def rank(self) -> Optional[int]:
        return self.raw.get("rank")

    @property
    def status(self) -> Optional[str]:
        return self.raw.get("status")

    @property
    def error(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("error"))

    @property
    def failed_in(self) -> Optional[str]:
        """The phase the rank's error happened in (None without an error)."""
        return self.error.get("phase")

    @property
    def shared_gpu(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("shared_gpu"))

    @property
    def script(self) -> Mapping[str, Any]:
        """What the script workload recorded: the calls, facts and remedies applied (empty for dsexp's own jobs)."""
        return _mapping(self.raw.get("script"))

    @property
    def fixes_applied(self) -> Mapping[str, Any]:
        return _mapping(_mapping(self.script.get("fixes")).get("applied"))

    @property
    def weights_held(self) -> Optional[int]:
        """The weights on the rank's device after init; for a user's script that made no engine call, after the
        last of its calls that recorded them (the model as the script left it: whole, on every rank)."""
        w = self.placed.weights_device
        if w is not None or not self.script or any(phase_kind(k) == "init" for k in self.phase_keys):
            return w
        held = (self.phase(k).weights_device for k in reversed(self.timeline_phases))
        return next((w for w in held if w is not None), None)

    @property
    def timeline_phases(self) -> Tuple[str, ...]:
        """The phase keys in the order the rank entered them (a phase that happened twice appears twice)."""
        return tuple(t.get("phase") for t in self.raw.get("timeline") or [])

    @property
    def clock(self) -> Mapping[str, float]:
        """Epoch marks: when the process was created, its timeline's zero (t0), when its record was complete."""
        return _mapping(self.raw.get("clock"))

    @property
    def phase_keys(self) -> Tuple[str, ...]:
        return tuple(_mapping(self.raw.get("phases")))

    @property
    def points(self) -> Tuple[Mapping[str, Any], ...]:
        """The workload points the rank listed, in the order it ran them (empty: a record without a grid)."""
        return tuple(self.raw.get("points") or ())

    @property
    def placed(self) -> PhaseRecord:
        """The phase that left the weights as generate found them: `quantize` where a quant member ran after the
        engine, else `init`."""
        quantized = self.phase(Phase.QUANTIZE)
        return quantized if quantized.recorded else self.phase(Phase.INIT)

    def phase(self, key: Union[Phase, str]) -> PhaseRecord:
        key = key.value if isinstance(key, Phase) else key
        raw = _mapping(self.raw.get("phases")).get(key)
        return PhaseRecord(key, raw) if raw else PhaseRecord.EMPTY

    def phases(self) -> Iterator[PhaseRecord]:
        return (self.phase(k) for k in self.phase_keys)

    def max_over_phases(self, key: str) -> Optional[int]:
        """The highest `peak(key)` over every phase the rank recorded."""
        return max((v for v in (ph.peak(key) for ph in self.phases()) if v is not None), default=None)


@dataclass(frozen=True)
class JobRecord:
    """A job's result.json: its config, status and failure, its ranks, what the engine did, the correctness check,
    the headline figures."""

    raw: Mapping[str, Any] = field(repr=False)

    @classmethod
    def of(cls, result: Union["JobRecord", Mapping[str, Any]]) -> "JobRecord":
        """The typed view of a result dict (a JobRecord is returned as it is)."""
        return result if isinstance(result, JobRecord) else cls(_mapping(result))

    @property
    def status(self) -> Optional[str]:
        return self.raw.get("status")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def config(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("config"))

    @property
    def tp(self) -> int:
        return int(self.config.get("tp") or 1)

    @property
    def failure(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("failure"))

    @property
    def cause(self) -> Optional[str]:
        return self.failure.get("cause")

    @property
    def completed(self) -> bool:
        """The job got through every phase (its output may still be wrong): its measurements are whole."""
        return self.ok or self.cause == "incorrect_output"

    @property
    def correctness(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("correctness"))

    @property
    def passed(self) -> bool:
        return self.ok and bool(self.correctness.get("passed"))

    @property
    def engine(self) -> Mapping[str, Any]:
        """What the engine did, as the job read it from the ranks: modules replaced, policy, fields read, trims."""
        return _mapping(self.raw.get("engine"))

    @property
    def runtime(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("runtime"))

    @property
    def baseline(self) -> Mapping[str, Any]:
        return _mapping(self.raw.get("baseline"))

    @property
    def versions(self) -> Mapping[str, str]:
        return _mapping(_mapping(self.raw.get("software")).get("versions"))

    @property
    def on_gpu(self) -> bool:
        return (self.runtime.get("device") or self.config.get("device")) == "cuda"

    @property
    def shared_gpu(self) -> bool:
        """Its ranks shared GPUs (gloo on one device): memory per rank is real, speed is not comparable."""
        return bool(self.runtime.get("shared_gpu"))

    @property
    def node_shared(self) -> bool:
        """Other jobs packed beside this one shared its node: node-wide figures are not its own."""
        return node_shared(self.raw)

    @property
    def speed_representative(self) -> bool:
        return speed_representative(self.raw)

    @property
    def ranks(self) -> Tuple[RankRecord, ...]:
        return tuple(RankRecord(rk) for rk in self.raw.get("ranks") or [] if rk)

    @property
    def logits_batch(self) -> Optional[int]:
        """The sequences of the correctness check's logits call (rank 0's point that made it, or was to make it);
        None where the record does not say: jobs before that call ran the first sequence alone made it at the
        point's batch."""
        rank = self.ranks[0] if self.ranks else None
        for entry in rank.points if rank else ():
            if entry.get("logits_batch"):
                return entry["logits_batch"]
        for phase in rank.phases() if rank else ():
            call = _mapping(phase.point.get("logits_call"))
            if call:
                return call.get("batch")
        return None

    def headline(self, name: str) -> Optional[float]:
        """A headline figure as recorded (`analysis.measured.headline` leaves out the ones not to compare)."""
        return _mapping(self.raw.get("headline")).get(name)
