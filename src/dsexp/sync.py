"""`python -m dsexp.sync SWEEP_DIR [--uri URI] [--experiment NAME]`: log a sweep's results into MLflow
(the command; the logic is dsexp.tracking.relog)."""

import sys

from dsexp.tracking.relog import main

if __name__ == "__main__":
    sys.exit(main())
