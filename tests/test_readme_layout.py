"""The README's layout section matches the tree: every top-level module and package of
``specserve/`` is named there, every module of the packages it lists file by file is
named, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "specserve"
# packages whose modules the layout names one by one
LISTED_PACKAGES = ("engine", "executor", "sampling", "methods")


def layout() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout")
    block = re.search(r"```\n(.*?)```", text[start:], re.S)
    assert block, "README.md: the Layout section has no code block"
    return block.group(1)


def test_every_top_level_module_and_package_is_named():
    words = set(re.findall(r"[\w./-]+", layout()))
    missing = []
    for entry in sorted(PKG.iterdir()):
        if entry.name.startswith(("_", ".")) and entry.name != "__main__.py":
            continue
        if entry.suffix == ".py":
            name = entry.name
        elif entry.is_dir() and entry.name != "__pycache__":
            name = entry.name + "/"
        else:
            continue
        if name not in words:
            missing.append(name)
    assert not missing, f"README.md layout does not name: {missing}"


def test_the_listed_packages_name_every_module():
    text = layout()
    missing = []
    for pkg in LISTED_PACKAGES:
        if pkg == "methods":  # one declaration per method: the method table lists them
            continue
        for f in sorted((PKG / pkg).glob("*.py")):
            if f.name != "__init__.py" and f.name not in text:
                missing.append(f"{pkg}/{f.name}")
    assert not missing, f"README.md layout does not name: {missing}"


def test_every_file_it_names_exists():
    named = set(re.findall(r"[\w/]+\.(?:py|c|sh|md)\b", layout()))
    files = {p.name for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts}
    paths = {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*")}
    gone = sorted(n for n in named if Path(n).name not in files and n not in paths)
    assert not gone, f"README.md layout names files that do not exist: {gone}"
