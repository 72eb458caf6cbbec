"""What the launcher starts on each rank of a user's script: `python -m dsexp.rank.workloads.script.entry <job_dir>`.

The launcher never sees the script's own arguments: its argparse would read `--n` or `--max` as abbreviations of its
own options (torchrun's --nnodes, --max-restarts; DeepSpeed's runner and launch.py the same way) and stop. The entry
reads them from the job file (runtime.script: the path and the arguments as dsexp filled them in), rebuilds sys.argv
as the launcher would have built it for the script (what the launcher put before the job folder, DeepSpeed's
`--local_rank=N`, stays before the script's arguments; anything after, after), starts the probes as the bootstrap
does in a rank run directly, and runs the script as `__main__` the way `python script.py` does: its folder first on
sys.path, its `__file__`, an uncaught exception reported from the script's first frame, exit code 1.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import List


def script_argv(argv: List[str], marker: str, path: str, args: List[str]) -> List[str]:
    """The script's sys.argv: `path`, what the launcher passed before `marker` (the job folder), the script's
    `args`, then what the launcher passed after `marker`."""
    at = argv.index(marker, 1)
    return [path, *argv[1:at], *args, *argv[at + 1 :]]


def read_script(job_dir: str) -> dict:
    from dsexp.core.protocol import JOB_FILE

    with open(os.path.join(job_dir, JOB_FILE), encoding="utf-8") as f:
        return json.load(f)["runtime"]["script"]


def start_probes() -> None:
    try:
        from dsexp.rank.workloads.script import start

        start()
    except Exception:  # dsexp must never stop the user's script: say why it measures nothing, and go on
        import traceback

        print("dsexp: the script's probes could not start:", file=sys.stderr)
        traceback.print_exc()


def run_as_main(path: str) -> None:
    """Run the file at `path` as `__main__`, as the interpreter runs a script named on its command line (runpy), its
    folder first on sys.path; an uncaught exception is reported from the script's own frames on, exit code 1."""
    file = os.path.abspath(path)
    sys.path[0] = os.path.dirname(os.path.realpath(file))  # not the folder the launcher ran in
    try:
        runpy.run_path(file, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        kind, exc, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename != file:  # runpy's own frames
            tb = tb.tb_next
        sys.excepthook(kind, exc, tb)
        raise SystemExit(1) from None


def main() -> None:
    from dsexp.core.protocol import SCRIPT_ENTRY_MODULE, SCRIPT_JOB_ENV

    job_dir = os.environ.get(SCRIPT_JOB_ENV)
    if not job_dir or job_dir not in sys.argv[1:]:
        raise SystemExit(f"usage: {SCRIPT_JOB_ENV}=JOB_DIR python -m {SCRIPT_ENTRY_MODULE} [OPTIONS] JOB_DIR")
    script = read_script(job_dir)
    sys.argv[:] = script_argv(sys.argv, job_dir, script["path"], list(script["argv"]))
    start_probes()
    run_as_main(script["path"])


if __name__ == "__main__":
    main()
