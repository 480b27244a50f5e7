"""The built-in models' names, for the checks that run before torch is imported (recipe.py, cli.py): builtin.py
says what each name is and imports torch. tests/cli/test_fast_failures.py checks that the two lists agree."""
from __future__ import annotations

BUILTIN_NAMES = ("tiny-llada2", "tiny-llada2.1", "tiny-llada2.1-block8", "tiny-llada", "tiny-llada2-random")


def is_builtin_name(name) -> bool:
    return isinstance(name, str) and name in BUILTIN_NAMES
