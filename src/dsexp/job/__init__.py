"""One Hydra job = one experiment: prepare the caches (checkpoint, tp=1 reference, per-rank split), launch the
ranks, tear them down, classify how they ended, and write `result.json`. Runs in the job's own environment;
the ranks it starts import nothing from here (see `dsexp.core.protocol`)."""
