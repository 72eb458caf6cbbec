"""Compose a job's config: the only package that imports Hydra or OmegaConf. Merges the composed config onto
the schema (`dsexp.core.schema`), validates it before anything is launched, and runs the sweep callbacks."""
