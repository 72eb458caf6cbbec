"""Test helpers that are packages of their own (import as `helpers.<name>`; tests/ is on sys.path)."""
