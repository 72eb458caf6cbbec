"""`python -m dsexp [-m] key=value ...`: one Hydra job per experiment; each job spawns its own ranks.

The Hydra app itself is dsexp.compose.app (compose/ is the only package that imports Hydra)."""

import sys

from dsexp.compose.app import main
from dsexp.core.compat import quiet_optional_imports


def run() -> None:
    """The app, ended by Ctrl-C or SIGTERM with words, not a traceback: the job then running has its result.json
    (cause `interrupted`), its ranks torn down; jobs already ok are skipped when the same command runs again."""
    quiet_optional_imports()
    try:
        main()
    except KeyboardInterrupt as e:
        why = str(e) or "Ctrl-C"
        sys.exit(
            f"dsexp: stopped ({why}); the job it was running is recorded as interrupted. Run the same command "
            "again to go on: jobs already ok are skipped, a budget search resumes from what it measured."
        )


if __name__ == "__main__":
    run()
