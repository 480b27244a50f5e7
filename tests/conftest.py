"""Shared by every test folder: tests/ itself is on sys.path (pytest puts a rootdir conftest's folder there), so
`checkpoints` (tiny HF checkpoints) and `oracle` (the independent float64 forward and the literal decoder of
docs/design.md §4) import from any subfolder."""
