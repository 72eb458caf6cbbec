"""Hydra callbacks: validate the whole sweep up front, open its MLflow parent run, summarise at the end."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dsexp.analysis.labels import config_label
from dsexp.core.records import node_shared
from dsexp.tracking.runs import OFF, Tracker, ensure_parent, read_sweep_state, resolve_uri


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from dsexp.compose.sweep import check_sweep, prepare_stacks

        errors, specs = check_sweep(config)
        errors = errors or prepare_stacks(specs)  # software stacks are ready before any job starts
        if errors:
            print("dsexp: the sweep was not started; fix these settings first:", file=sys.stderr)
            for combo, err in errors:
                print(f"  [{' '.join(combo)}] {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if config.launcher.pack:
            start_packing(config, sweep_dir)
        open_parent_run(config, sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = collect_results(sweep_dir)
        print(format_table(results))
        print(format_cache_use(results))
        off = resolve_uri(config.tracking.uri) == OFF
        if not off and any(not (res.get("tracking") or {}).get("run_id") for res in results):
            retry_tracking(sweep_dir)
        state = read_sweep_state(sweep_dir)
        summarise_sweep(sweep_dir, state)
        if state:
            try:
                Tracker(state["uri"], state["experiment"]).set_status(state["run_id"], "FINISHED")
            except Exception as e:
                print(f"dsexp: could not close the MLflow parent run: {e}", file=sys.stderr)
            where = state["uri"] if state["uri"].startswith("http") else "`make ui` (http://127.0.0.1:5000)"
            print(
                f"MLflow: experiment '{state['experiment']}', parent run {state['run_id']} in {state['uri']}\n"
                f"        open it with {where}"
            )

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run (no -m): its report beside its result.json, as a sweep's is beside its jobs."""
        job_return = kwargs.get("job_return")
        hydra_cfg = getattr(job_return, "hydra_cfg", None)
        if hydra_cfg is None:
            return
        run_dir = Path(hydra_cfg.hydra.runtime.output_dir)
        if (run_dir / "result.json").is_file():
            summarise_sweep(run_dir, None)


def start_packing(config: DictConfig, sweep_dir: Path) -> None:
    """launcher.pack=true: fix the sweep's GPU pool (from this process's view) for the jobs to claim from."""
    from dsexp.job.cluster.packing import init_pool

    pool = init_pool(sweep_dir)
    print(
        f"dsexp: launcher.pack=true: jobs running at once get disjoint GPUs of [{','.join(pool)}]"
        + ("" if pool else " (no GPU here: jobs share the host and are only marked as overlapping)")
    )
    if str(config.hydra.launcher.get("_target_", "")).endswith("BasicLauncher"):
        print(
            "dsexp: Hydra's basic launcher runs one job at a time, so nothing is packed; "
            "add hydra/launcher=dsexp_local to run the jobs at once",
            file=sys.stderr,
        )


def open_parent_run(config: DictConfig, sweep_dir: Path) -> None:
    """Create the store and the sweep's parent run once, before any job (reused when a sweep is resumed)."""
    uri = resolve_uri(config.tracking.uri, Path(os.getcwd()))
    if uri == OFF:
        print(f"dsexp: tracking=none: results stay in result.json files; log them later with: "
              f"python -m dsexp.sync {sweep_dir}", file=sys.stderr)  # fmt: skip
        return
    try:
        tracker = Tracker(uri, config.tracking.experiment)
        state = ensure_parent(
            sweep_dir,
            tracker,
            config.tracking.experiment,
            {"dsexp.overrides": " ".join(config.hydra.overrides.task)[:4000]},
        )
        if not state["created"]:
            tracker.set_status(state["run_id"], "RUNNING")
    except Exception as e:
        print(
            f"dsexp: MLflow store {uri} unavailable ({e}); results go to result.json files only. "
            f"Re-log them later with: python -m dsexp.sync {sweep_dir}",
            file=sys.stderr,
        )


def collect_results(sweep_dir: Path) -> List[Dict[str, Any]]:
    from dsexp.analysis.sources import results_from_dir

    return results_from_dir(sweep_dir)


def retry_tracking(sweep_dir: Path) -> None:
    """Jobs the store missed during the sweep get one more try now (as `python -m dsexp.sync` would)."""
    from dsexp.tracking.relog import sync_sweep

    out = sync_sweep(sweep_dir)
    if out["failed"]:
        print(
            f"dsexp: {len(out['failed'])} jobs are not in MLflow yet; log them later with: "
            f"python -m dsexp.sync {sweep_dir}",
            file=sys.stderr,
        )


def summarise_sweep(sweep_dir: Path, state) -> None:
    """End-of-sweep analysis (report tables, plots) into the sweep folder and the parent run."""
    try:
        from dsexp.tracking.upload import report_sweep
    except ImportError:
        return
    try:
        report_sweep(sweep_dir, parent=state)
    except Exception as e:  # a report bug must not lose the sweep
        print(f"dsexp: report failed: {type(e).__name__}: {e}", file=sys.stderr)


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and 0 < abs(v) < 10**-nd * 10:  # tiny models: keep 3 significant digits, not "0.00"
        return f"{v:.3g}"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def format_cache_use(results: List[Dict[str, Any]]) -> str:
    """One line: how often each cached artefact was reused (hit) or computed (miss) by this sweep's jobs."""
    from collections import Counter

    uses = [(res.get("runtime") or {}).get("cache") or {} for res in results]
    parts = []
    for what in ("checkpoint", "reference", "split"):
        n = Counter(u.get(what) for u in uses)
        if n["hit"] or n["miss"]:
            parts.append(f"{what} {n['hit']} hit{'s' * (n['hit'] != 1)} / {n['miss']} computed")
    return "dsexp caches: " + ("; ".join(parts) if parts else "none used")


def format_table(results: List[Dict[str, Any]]) -> str:
    """One row a job, headline metrics; failed jobs show their cause; SLURM jobs their id, node and final state."""
    cols = [
        "job",
        "config",
        "status",
        "gpu_peak_gib",
        "gpu_weights_gib",
        "host_peak_gib",
        "node_host_peak_gib",
        "load_s",
        "init_s",
        "generate_s",
        "tokens_per_s",
        "rel_err",
    ]
    rows = [cols]
    for res in results:
        h, c = res.get("headline") or {}, res.get("config") or {}
        corr = res.get("correctness") or {}
        status = (
            res.get("status", "?")
            if res.get("status") == "ok"
            else f"{res.get('status')}:{(res.get('failure') or {}).get('cause')}"
        )
        name = f"{config_label(c)}/tp{c.get('tp')}"
        shared = node_shared(res)  # packed with other jobs: the node's memory was theirs too
        rows.append(
            [Path(res.get("job_dir", "?")).name, name, status]
            + ["shared" if shared and k.startswith("node_") else _fmt(h.get(k)) for k in cols[3:-1]]
            + [_fmt(corr.get("logits_rel_err"), 4) if corr.get("logits_rel_err") is not None else "-"]
        )
    if any(res.get("slurm") for res in results):  # SLURM jobs: their id, node and SLURM's final state
        rows[0] += ["slurm_job", "node", "slurm_state", "queued_s"]
        for row, res in zip(rows[1:], results):
            sl = res.get("slurm") or {}
            row += [sl.get("job_id") or "-", sl.get("node") or sl.get("nodelist") or "-", sl.get("state") or "-"]
            row.append(_fmt(sl.get("submit_to_start_s"), 0) if sl.get("submit_to_start_s") is not None else "-")
        cols = rows[0]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows)
