"""What every stage shares, on the standard library alone: the job schema, the record format, the job <-> rank
protocol and the version gates the engines and trims declare (their traits are in dsexp.engines, dsexp.trims). The
ranks import it in software stacks where Hydra, OmegaConf and MLflow do not exist, so nothing here imports a
third-party package at module level."""
