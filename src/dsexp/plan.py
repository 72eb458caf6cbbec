"""`python -m dsexp.plan <overrides>`: the memory of every configuration, predicted from the config alone, on any
machine, in seconds; nothing is launched and no weight is read. The command line is dsexp.compose.planning's (the only
stage that composes with Hydra); `python -m dsexp.plan --help` lists its options."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from dsexp.compose.planning import main

    sys.exit(main())
