"""`python -m dsexp [-m] key=value ...`: one Hydra job per experiment; each job spawns its own ranks.

The Hydra app itself is dsexp.compose.app (compose/ is the only package that imports Hydra)."""

from dsexp.compose.app import main

if __name__ == "__main__":
    main()
