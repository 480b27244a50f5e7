"""README's Layout section against the tree: every module of the package and every folder of tests/ and tools/ is
named there, and every file it names exists (so the section cannot drift from the code unnoticed)."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    start = section.index("```") + 3
    return section[start : section.index("```", start)]


def named(block: str) -> set[str]:
    return set(re.findall(r"[\w*][\w.*/-]*", block))


def test_every_module_and_folder_is_in_the_layout():
    block = layout_block()
    words = named(block)
    patterns = [w for w in words if "*" in w]
    missing = []
    for p in sorted((ROOT / "compiledllm").rglob("*.py")):
        if p.name in ("__init__.py", "__main__.py"):
            continue
        if p.name not in words and p.stem not in words and not any(fnmatch.fnmatch(p.name, q) for q in patterns):
            missing.append(str(p.relative_to(ROOT)))
    for top in ("tests", "tools"):
        for d in sorted((ROOT / top).iterdir()):
            if d.is_dir() and not d.name.startswith(("_", ".")) and d.name not in block:
                missing.append(str(d.relative_to(ROOT)))
    assert not missing, f"not in README's Layout: {missing}"


def test_every_file_the_layout_names_exists():
    names = {w for w in named(layout_block()) if w.endswith((".py", ".md", ".cu", ".sh")) and "*" not in w}
    files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts} | {
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts}
    stale = sorted(n for n in names if n not in files and n.split("/")[-1] not in files)
    assert not stale, f"README's Layout names files that do not exist: {stale}"
