"""The cluster side of a job: SLURM (what a job and the sweep process ask it, and following a sweep's jobs to their
end: `slurm`, `slurm_sweep`), jobs whose ranks span nodes (`multinode`) and jobs of a sweep packed onto disjoint GPUs
(`packing`). Without Hydra: the Hydra launchers that use this are dsexp.compose.launchers."""
