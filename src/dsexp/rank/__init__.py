"""What runs under torchrun: one rank's phases (start, load, init, generate), its loaders, engines and probes.

Imports only the standard library, torch, transformers, deepspeed, safetensors, psutil, nvidia-ml-py and
dsexp's `core` and `models`: the ranks may run in a software stack where Hydra, OmegaConf and MLflow are
absent (`tests/test_layout.py` checks a real rank's sys.modules)."""
