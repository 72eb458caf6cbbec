"""Hydra discovers launchers under `hydra_plugins`; dsexp's logic lives in dsexp.compose.launchers.

Hydra registers a plugin under `<its __module__>.<its name>` and instantiates only classes whose name is
inside `hydra_plugins`, so the launchers are (empty) subclasses defined here, not re-exports. They
subclass hydra-submitit-launcher's; where that plugin is not installed (e.g. the GPU image, which runs
the basic launcher) this module defines nothing, so Hydra's plugin scan stays quiet.
"""

try:
    from dsexp.compose import launchers as _impl
except ImportError:  # hydra-submitit-launcher missing: no cluster launchers
    _impl = None

if _impl is not None:

    class DsexpSlurmLauncher(_impl.DsexpSlurmLauncher):
        """`hydra/launcher=dsexp_slurm`: one SLURM job per dsexp job, sized from its own tp."""

    class DsexpLocalLauncher(_impl.DsexpLocalLauncher):
        """`hydra/launcher=dsexp_local`: the same path in local submitit processes."""
