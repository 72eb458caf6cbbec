"""The budget sweeper (`hydra/sweeper=dsexp_budget`, dsexp's default sweeper): without budget.* it is Hydra's basic
sweeper; with a budget the sweep's dimensions are a space to search and the batch is searched in each configuration.

It composes and validates every configuration of the space (as the sweep's start did), asks the memory model for each
(dsexp.compose.budget.model), rebuilds what the sweep folder already measured (a resumed search: every result.json of
an earlier run of the same folder counts; nothing is overwritten, new jobs take new numbers), then hands the
configurations the search picks (dsexp.compose.budget.search) to Hydra's launcher round by round: `budget_jobs_at_once`
jobs a round (1: strictly in order of predicted benefit, each result feeding the next guess). After every round the
search's state is written to `<sweep>/budget.json`, which the report's budget section reads.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from dsexp.analysis.budget_runs import ONE_BATCH_PER_JOB, STATE_FILE
from dsexp.compose.budget import points as measured
from dsexp.compose.budget import search
from dsexp.compose.budget.model import Predicted, describe, need_at, predict_config
from dsexp.core.fs import write_json_atomic
from dsexp.core.schema import ConfigError, JobConfig
from dsexp.core.workload import BATCH_KEY, BISECT_KEY

log = logging.getLogger(__name__)
GIB = 2**30


def budget_active(config: DictConfig) -> bool:
    b = OmegaConf.select(config, "budget") or {}
    return any(b.get(k) is not None for k in ("gpus", "gpu_gib", "host_gib"))


class Space:
    """The sweep's dimensions and every configuration of their product, each with its overrides."""

    def __init__(self, arguments: List[str], config_loader=None):
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
        self.dims = [o.get_key_element() for o in parsed if o.is_sweep_override()]
        given = {o.get_key_element() for o in parsed}
        problems = []
        if BATCH_KEY in given:
            problems.append(f"{BATCH_KEY} is what a budget searches; set budget.batch_min/batch_max/batch_step instead")
        problems += [
            f"{d}: one budget a search (sweep budgets as separate searches)"
            for d in self.dims
            if d.startswith("budget.")
        ]
        if problems:
            raise ConfigError("; ".join(problems))
        self.combos = BasicSweeper.split_arguments(parsed, None)[0]

    def coordinates(self, combo: List[str]) -> Dict[str, str]:
        out = {}
        for item in combo:
            key, _, value = item.partition("=")
            if key in self.dims:
                out[key] = value
        return out


class BudgetSearch:
    def __init__(self, sweeper: BasicSweeper, arguments: List[str], width: int):
        self.sweeper, self.width = sweeper, max(1, width)
        self.config = sweeper.config
        self.sweep_dir = Path(str(self.config.hydra.sweep.dir))
        self.space = Space(arguments, sweeper.hydra_context.config_loader)
        self.overrides: Dict[str, List[str]] = {}
        self.predicted: Dict[str, Predicted] = {}
        self.identity: Dict[str, str] = {}
        self.specs: Dict[str, JobConfig] = {}
        self.state = self._initial_state()
        self.job_idx = 1 + max((int(p.name) for p in self.sweep_dir.glob("*") if p.name.isdigit()), default=-1)
        self.jobs: List[Dict[str, Any]] = []  # every job this search launched or found: folder, config, batches

    # --- set-up -----------------------------------------------------------------------------------------------

    def _spec(self, combo: List[str]) -> JobConfig:
        from dsexp.compose.config import to_schema
        from dsexp.compose.sweep import requested_gpus
        from dsexp.compose.validate import validate

        cfg = self.sweeper.hydra_context.config_loader.load_sweep_config(self.config, list(combo))
        return validate(to_schema(cfg), requested_gpus(cfg))

    def _initial_state(self) -> search.State:
        first = self._spec(self.space.combos[0])
        b = first.budget
        if first.generate.prompt_tokens is None or isinstance(first.generate.prompt_tokens, (list, tuple)):
            raise ConfigError(
                f"generate.prompt_tokens={first.generate.prompt_tokens}: a budget search holds one context; "
                "set generate.prompt_tokens=N (tokens of each prompt)"
            )
        batches = search.batch_range(b.batch_min, b.batch_max, b.batch_step)
        configs = []
        for combo in self.space.combos:
            coords = self.space.coordinates(combo)
            key = " ".join(f"{k}={v}" for k, v in coords.items()) or "as given"
            configs.append(self._config(key, list(combo), coords, batches))
        host = int(b.host_gib * GIB) if b.host_gib is not None else None
        return search.State(int(b.gpu_gib * GIB), batches, configs, host)

    def _config(self, key: str, combo: List[str], coords: Dict[str, str], batches: List[int]) -> search.Config:
        """A configuration of the search: composed, validated and predicted (the allocator's replay included)."""
        spec = self._spec(combo)
        pred = predict_config(spec, batches)
        self.overrides[key], self.predicted[key], self.specs[key] = combo, pred, spec
        self.identity[key] = measured.identity(_config_dict(spec))
        one_batch = spec.workload == "script"  # its batch is an argument: one a job ({batch_size})
        one_load = not one_batch and spec.budget.one_load
        replayed = None if pred.replayed is None else max((i for i, x in enumerate(batches) if x <= pred.replayed),
                                                         default=-1)  # fmt: skip
        above = [x for x in batches if pred.kernel_limit and x > pred.kernel_limit["batch"]]
        points = [search.Point(min(above), search.LIMIT)] if above else []  # never launched: the kernel would fault
        if above:  # the first guess stays under the kernel's limit too
            under = batches.index(min(above)) - 1
            replayed = under if replayed is None else min(replayed, under)
        return search.Config(key, coords, pred.needs, spec.tp, one_batch, one_load, pred.miss, replayed=replayed,
                             confirm_margin=confirm_margin(spec), failed=pred.fails, points=points)  # fmt: skip

    def add_allocator_twins(self) -> int:
        """Where the caching allocator's fragmentation decided a settled bracket (search.allocator_decided), the same
        configuration with expandable segments joins the search (the setting PyTorch's own out-of-memory message
        recommends), so that the answer gives both batches. Returns how many joined."""
        added = 0
        for c in list(self.state.configs):
            combo = allocator_twin(self.specs[c.key], self.overrides[c.key], c)
            key = f"{c.key} {ALLOCATOR_DIM}=expandable_segments"
            if combo is None or key in self.overrides or not search.allocator_decided(c, self.state):
                continue
            twin = self._config(key, combo, {**c.dims, ALLOCATOR_DIM: "expandable_segments"}, self.state.batches)
            twin.twin_of = c.key
            self.state.configs.append(twin)
            print(f"dsexp budget: the allocator's fragmentation decided {c.key}: searching it with expandable segments")
            added += 1
        return added

    # --- measured points ----------------------------------------------------------------------------------------

    def absorb(self, job_dir: Path, result: Optional[Dict[str, Any]], resumed: bool = False) -> None:
        """Add a job's points to its configuration (found by its settings, whatever job number it has); resumed: an
        earlier search's job."""
        if not result:
            return
        ident = measured.identity(result.get("config") or {})
        key = next((k for k, i in self.identity.items() if i == ident), None)
        if key is None:
            return
        c = next(c for c in self.state.configs if c.key == key)
        job_dir = Path(result.get("job_dir") or job_dir)  # as the job recorded itself (the report matches on it)
        if any(j["dir"] == str(job_dir) for j in self.jobs):
            return
        points, stop = measured.points_of(job_dir, result, resumed)
        if stop and past_kernel_limit(c, result):
            stop = None  # the crash is the limit the search already keeps out (an earlier search's, or no limit then)
            print(f"dsexp budget: {key}: job {job_dir.name} failed past the kernel's limit: searched under it")
        for p in points:  # a point that ran past the budget (not capped, or outside the allocator) does not fit it
            if p.status == search.OK and p.peak is not None and p.peak > self.state.device:
                p.status = search.OVER
        c.points += [p for p in points if p.status != search.FAILED and search.adds_to(c, p)]
        if stop:
            c.failed = stop
        over = self._over_host(result)
        if over and not c.failed:
            c.failed = over
        entry = {
            "dir": str(job_dir),
            "config": key,
            "batches": [p.batch for p in points if p.status != search.FAILED] or measured.job_batches(result["config"]),
            "searched_from": ((result.get("config") or {}).get("generate") or {}).get("bisect_from"),
            "wall_s": measured.wall_s(result),
        }
        uncounted = measured.not_as_load(result)
        if uncounted:
            entry["not_counted"] = sorted(uncounted)
            for batch, cached in sorted(uncounted.items()):
                print(
                    f"dsexp budget: {key}: batch {batch} of job {job_dir.name} started with {cached / 2**20:.0f} MiB "
                    "in cached blocks, more than the load left: not counted, searched again in a fresh load"
                )
        self.jobs.append(entry)

    def _over_host(self, result: Dict[str, Any]) -> Optional[str]:
        host = measured.host_need(result)
        if self.state.host is None or host is None or host <= self.state.host:
            return None
        return f"host: the ranks held {host / GIB:.2f} GiB, over the budget's {self.state.host / GIB:.2f} GiB"

    def resume(self) -> int:
        for job_dir, result in measured.sweep_results(self.sweep_dir):
            if result.get("cut_short") and not (job_dir / measured.RESULT).exists():
                write_json_atomic(job_dir / measured.RESULT, result)  # the report reads it too
            self.absorb(job_dir, result, resumed=True)
        return len(self.jobs)

    # --- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> List[Sequence[Any]]:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        found = self.resume()
        if self.add_allocator_twins():
            found = self.resume()  # an earlier run's twin jobs, found now that their configurations are known
        if found:
            print(f"dsexp budget: resumed from {found} jobs already in {self.sweep_dir}")
        self._announce()
        returns = []
        try:
            while True:
                todo = search.next_round(self.state, self.width)
                if not todo:
                    break
                batch = [self.overrides[c.key] + batch_overrides(c, job) for c, job in todo]
                self.sweeper.validate_batch_is_legal(batch)
                results = self.sweeper.launcher.launch(batch, initial_job_idx=self.job_idx)
                for i, ((c, job), ret) in enumerate(zip(todo, results)):
                    job_dir = self.job_dir(ret, self.job_idx + i)
                    before = len(c.points)
                    self.absorb(job_dir, measured.read_json(job_dir / measured.RESULT))
                    if len(c.points) == before and not c.failed:  # never ask for the same thing twice
                        c.failed = f"its job {job_dir} recorded none of the batches {job.batches}"
                self.add_allocator_twins()
                self.job_idx += len(batch)
                returns.append(results)
                self.save()
        finally:
            self.absorb_unrecorded()
            self.save(final=True)
        return returns

    def absorb_unrecorded(self) -> None:
        """The jobs of this sweep whose results are not yet the search's: the one a stop (Ctrl-C, a time limit)
        interrupted in its launch wrote its result as it ended, so that budget.json lists every job folder."""
        for job_dir, result in measured.sweep_results(self.sweep_dir):
            self.absorb(job_dir, result)  # a job already the search's is left as it is

    def job_dir(self, ret: Any, num: int) -> Path:
        """Where a launched job wrote its result: its Hydra output folder (the basic and submitit launchers give the
        job's config; with hydra.job.chdir=false Hydra's working_dir is the launch folder), else the launcher's
        working_dir (dsexp's SLURM launcher), else the sweep's numbered subfolder."""
        cfg = getattr(ret, "hydra_cfg", None)
        out = OmegaConf.select(cfg, "hydra.runtime.output_dir") if OmegaConf.is_config(cfg) else None
        for cand in (out, getattr(ret, "working_dir", None)):
            if cand and (Path(cand) / measured.RESULT).is_file():
                return Path(cand)
        return self.sweep_dir / str(num)

    def _announce(self) -> None:
        s = self.state
        print(
            f"dsexp budget: {len(s.configs)} configurations x {len(s.batches)} batches "
            f"({s.batches[0]}..{s.batches[-1]}) = {len(s.configs) * len(s.batches)} runs in the full grid; "
            f"at most {search.run_bound(len(s.batches))} runs per configuration{_one_batch_note(s)}"
        )
        for c in s.configs:
            if c.miss is not None:
                print(f"  not launched: {c.key}: {describe(c.miss)}")
            elif self.predicted[c.key].fails:
                print(f"  not launched: {c.key}: {self.predicted[c.key].fails}")

    def save(self, final: bool = False) -> None:
        s = self.state
        data = {
            "saved": time.time(),
            "dims": self.space.dims,
            "budget": {"device": s.device, "host": s.host, **_config_dict(self.specs[s.configs[0].key])["budget"]},
            "device": self.specs[s.configs[0].key].device,
            "prompt_tokens": self.specs[s.configs[0].key].generate.prompt_tokens,
            "new_tokens": self.specs[s.configs[0].key].generate.new_tokens,
            "batches": s.batches,
            "run_bound": search.run_bound(len(s.batches)),
            "one_batch_per_job": any(c.one_batch for c in s.configs),
            "full_grid_runs": len(s.configs) * len(s.batches),
            "runs": sum(search.runs_used(c) for c in s.configs),
            "jobs": self.jobs,
            "configs": [self._config_entry(c, final) for c in s.configs],
        }
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.sweep_dir / STATE_FILE, data)

    def what_if(self, c: search.Config) -> Dict[str, Any]:
        """What the budget would need for twice the largest batch that ran, and for the next tp down (the model,
        plus the configuration's measured gap)."""
        b = search.largest_ok(c, self.state.batches)
        if b is None:
            return {}
        spec, shift = self.specs[c.key], search.own_gap(c, self.state.batches, self.state.device) or 0
        double = need_at(spec, 2 * b)
        smaller = sorted({s.tp for s in self.specs.values() if s.tp < spec.tp}) or (
            [spec.tp // 2] if spec.tp > 1 else []
        )
        down = {t: need_at(spec, b, t) for t in smaller[-1:]}
        return {
            "double_batch": None if double is None else double + shift,
            "tp_down": {str(t): n + shift for t, n in down.items() if n is not None},
        }

    def _config_entry(self, c: search.Config, final: bool = False) -> Dict[str, Any]:
        s, pred = self.state, self.predicted[c.key]
        guess = search.model_largest(c, s.device)
        shift = search.gap(c, s)  # its own measured gap, else a neighbour's: where the search looked next
        shifted = search.model_largest(c, s.device, shift)
        lo, hi = search.bracket(c, s.batches)
        return {
            "key": c.key,
            "dims": c.dims,
            "overrides": self.overrides[c.key],
            "tp": c.gpus,
            "miss": None if c.miss is None else {**c.miss.__dict__, "text": describe(c.miss)},
            "failed": c.failed,
            "fails_in_init": pred.fails,  # foreseen on the meta device: never launched
            "predicted_largest": s.batches[guess] if guess >= 0 else None,
            "predicted_host": pred.host,
            "terms_at_min": pred.terms,
            "needs": c.needs,
            "note": pred.note,
            "replay": pred.replay,
            "kernel_limit": pred.kernel_limit,
            "gap": search.own_gap(c, s.batches, s.device),
            "shift": shift,
            "shifted_largest": s.batches[shifted] if shifted >= 0 else None,
            "points": [p.__dict__ for p in sorted(c.points, key=lambda p: p.batch)],
            "loads": search.loads_used(c),
            "twin_of": c.twin_of,
            "allocator_decided": self.specs[c.key].device != "cpu" and search.allocator_decided(c, s),
            "one_load": c.one_load,
            "largest_ok": s.batches[lo] if lo >= 0 else None,
            "smallest_oom": s.batches[hi] if hi < len(s.batches) else None,
            "settled": search.done(c, s),
            "what_if": self.what_if(c) if final else {},
        }


def past_kernel_limit(c: search.Config, result: Dict[str, Any]) -> bool:
    """The job failed in a batch at or past the configuration's kernel limit (its LIMIT point): int4's fault past
    2^31 output elements, met by a search from before the limit was known."""
    from dsexp.core.workload import parse_phase

    limit = min((p.batch for p in c.points if p.status == search.LIMIT), default=None)
    failed_at = parse_phase(str((result.get("failure") or {}).get("phase") or ""))
    return limit is not None and failed_at is not None and failed_at.batch >= limit


def confirm_margin(spec: JobConfig) -> int:
    """The headroom under the budget below which the search runs an answer found after other points of its load
    again, first in a fresh load (budget.confirm_first, budget.confirm_margin_gib; search.fresh_answer), in bytes;
    0 (never) but for dsexp's own workload searched in one load on a GPU, whose caching allocator a process's first
    generate meets (a CPU run's budget is simulated, the same at every point)."""
    b = spec.budget
    confirms = b.confirm_first and b.one_load and spec.device == "cuda" and spec.workload != "script"
    return int(b.confirm_margin_gib * GIB) if confirms else 0


ALLOCATOR_DIM = "allocator"
EXPANDABLE_OVERRIDE = "++trim.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def allocator_twin(spec: JobConfig, overrides: List[str], c: search.Config) -> Optional[List[str]]:
    """The overrides of c with expandable segments, where a twin can answer: dsexp's own workload on a GPU (a CPU run
    has no caching allocator; a script sets it with its own remedy, script.fix=context), not already expandable
    and not itself a twin."""
    if c.twin_of or c.one_batch or spec.device == "cpu":
        return None
    if "expandable_segments" in str((spec.trim.env or {}).get("PYTORCH_CUDA_ALLOC_CONF") or ""):
        return None
    return [*overrides, EXPANDABLE_OVERRIDE]


def batch_overrides(c: search.Config, job: search.Job) -> List[str]:
    """The batches a job runs: a search inside one load from its start, a grid inside one load (dsexp's pipeline), or
    the one batch a script's {batch_size} takes."""
    if c.one_batch:
        (b,) = job.batches
        return [f"{BATCH_KEY}={b}"]
    grid = [f"{BATCH_KEY}=[{','.join(map(str, job.batches))}]"]
    return grid if job.start is None else [*grid, f"{BISECT_KEY}={job.start}"]


def _one_batch_note(s: search.State) -> str:
    if not any(c.one_batch for c in s.configs):
        return ""
    return f" ({ONE_BATCH_PER_JOB})"


def _config_dict(spec: JobConfig) -> Dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


def width_of(config: DictConfig) -> int:
    return int(OmegaConf.select(config, "hydra.sweeper.budget_jobs_at_once") or 1)


class BudgetSweeper(BasicSweeper):
    """Hydra's basic sweeper, or, with a budget, the search (module docstring)."""

    def __init__(
        self,
        max_batch_size: Optional[int] = None,
        params: Optional[Dict[str, str]] = None,
        budget_jobs_at_once: int = 1,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.width = budget_jobs_at_once

    def sweep(self, arguments: List[str]) -> Any:
        assert self.config is not None and self.hydra_context is not None
        if not budget_active(self.config):
            return super().sweep(arguments)
        params = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        try:
            return BudgetSearch(self, params, self.width).run()
        except ConfigError as e:
            print(f"dsexp: the budget search was not started: {e}", file=sys.stderr)
            sys.exit(2)
