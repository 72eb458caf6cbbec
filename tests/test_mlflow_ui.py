"""The MLflow UI as a person sees it: a real CPU sweep, `mlflow ui` on 127.0.0.1, the sweep's comparison view opened
in headless Chromium; the sweep's runs and a headline metric with its value must be on the rendered page.
The screenshot is kept in the test's tmp dir, and copied to results/ui/ when DSEXP_UI_ARTIFACTS=1."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.run import ROOT, run_dsexp

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=2400,1200",
    "--virtual-time-budget=30000",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 240) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def chromium(binary: str, profile: Path, *args: str) -> str:
    proc = subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=240
    )
    return proc.stdout


def page_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sweep_comparison_view_in_the_mlflow_ui(tmp_path, cache_dir):
    from mlflow.tracking import MlflowClient

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("needs Debian's chromium package (apt-get install chromium)")
    run_dsexp(["-m", "tp=1,2", "model=tiny", "hydra.sweep.dir=multirun/s"], tmp_path, cache_dir)
    route = re.search(
        r"side-by-side view of the runs: `(#/experiments/[^`]+)`",
        (tmp_path / "multirun" / "s" / "summary.md").read_text(),
    ).group(1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    jobs = client.search_runs([client.get_experiment_by_name("dsexp").experiment_id], "tags.dsexp.kind = 'job'")
    port = free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlflow")),
            "ui",
            "--backend-store-uri",
            uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health")
        url = f"{base}/{route}"
        text = page_text(chromium(binary, tmp_path / "profile-dom", "--dump-dom", url))
        shot = tmp_path / "mlflow-ui-sweep.png"
        chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert "You're viewing a shared view" in text
    for run in jobs:
        assert run.info.run_name in text  # tiny/eager/init_inference/bf16/tp1 and .../tp2
        value = run.data.metrics["gpu_weights_gib"]
        assert f"{value}"[:6] in text, (run.info.run_name, value)
    assert "gpu_weights_gib" in text and "host_peak_gib" in text
    assert shot.stat().st_size > 20_000
    if os.environ.get("DSEXP_UI_ARTIFACTS") == "1":
        keep = ROOT / "results" / "ui"
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, keep / shot.name)
