"""dsexp's bootstrap: reaches every rank of a user's script through the launcher's environment.

dsexp's launchers start dsexp.rank.workloads.script.entry on a script's ranks (so that the launcher's argparse never
reads the script's arguments), and the entry starts the probes itself once sys.argv is the script's; this module
starts them in a rank that runs the script directly (`python script.py`). The job puts this folder first on
PYTHONPATH; Python's `site` imports `sitecustomize` at start-up in every process the launcher starts (torchrun and
the DeepSpeed launcher pass PYTHONPATH on, also to other nodes). It turns on only in a rank running the script
(DSEXP_SCRIPT_JOB and RANK set, sys.argv[0] is the script): torchrun's agent, the DeepSpeed runner and launch.py, the
entry, and any other Python the script starts are left alone. There it hands over to the script workload, which
installs the hooks before the script's first line. A `sitecustomize` further down the path is imported too, as it
would have been without dsexp. Standard library only here.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _rank_of_the_script() -> bool:
    script = os.environ.get("DSEXP_SCRIPT")
    if not (script and os.environ.get("DSEXP_SCRIPT_JOB") and "RANK" in os.environ and sys.argv and sys.argv[0]):
        return False
    return os.path.realpath(sys.argv[0]) == os.path.realpath(script)


def _next_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if _rank_of_the_script():
    try:
        from dsexp.rank.workloads.script import start

        start()
    except Exception:  # dsexp must never stop the user's script: say why it measures nothing, and go on
        import traceback

        print("dsexp: the script's probes could not start:", file=sys.stderr)
        traceback.print_exc()
_next_sitecustomize()
