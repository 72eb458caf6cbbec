"""What runs under torchrun: one rank's phases (start, load, init, generate), its loaders and probes; the engines
and trims it runs are their families' rank parts (dsexp.engines.<name>.rank, dsexp.trims.<key>.rank).

Imports only the standard library, torch, transformers, deepspeed, safetensors, psutil, nvidia-ml-py and
dsexp's `core`, `models` and the families' rank parts and traits: the ranks may run in a software stack where
Hydra, OmegaConf and MLflow are absent (`tests/test_layout.py` checks a real rank's sys.modules)."""
