"""Models: the presets' architectures, the random-weight checkpoint writer, the kernel-policy scan, and the
InternLM2 remote code dsexp writes next to its checkpoints. Used by the job (writing), the ranks and analysis."""
