"""Campaigns: the runs behind a results folder, as data (campaigns/<name>.yaml), remade by one command:
`python -m dsexp.campaign NAME` (or `make campaign NAME=...`). spec: the file; runner: the runner."""
