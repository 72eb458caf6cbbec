"""What every stage shares, on the standard library alone: the job schema, the engine traits, the record
format and the job <-> rank protocol. The ranks import it in software stacks where Hydra, OmegaConf and
MLflow do not exist, so nothing here imports a third-party package at module level."""
