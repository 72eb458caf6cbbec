"""Modeling code that dsexp writes next to generated checkpoints (loaded with trust_remote_code)."""
