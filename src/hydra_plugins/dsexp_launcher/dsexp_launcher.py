"""Hydra discovers launchers under `hydra_plugins`; dsexp's live in dsexp.cluster_launchers.

They subclass hydra-submitit-launcher's; where that plugin is not installed (e.g. the GPU image, which
runs the basic launcher) this module defines nothing, so Hydra's plugin scan stays quiet.
"""
try:
    from dsexp.cluster_launchers import DsexpLocalLauncher, DsexpSlurmLauncher, launcher_params  # noqa: F401
except ImportError:  # hydra-submitit-launcher missing: no cluster launchers
    pass
