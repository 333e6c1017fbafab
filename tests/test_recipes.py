"""CONTRIBUTING.md's recipes are true: every path they name exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Recipes"


def _recipe_paths() -> list[str]:
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert SECTION in text, f"CONTRIBUTING.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert "\n### " in section, "the recipes section has no recipe"
    named = re.findall(r"`([^`\s]+)`", section)
    # Paths: with a folder or a file suffix; NAME stands for a new module.
    return [
        path
        for path in named
        if ("/" in path or re.search(r"\.(py|md|toml|lock)$", path))
        and "NAME" not in path
    ]


def test_every_path_a_recipe_names_exists():
    paths = _recipe_paths()
    assert len(paths) >= 10, f"the recipes name too few paths: {paths}"
    missing = [path for path in paths if not (REPO / path).exists()]
    assert not missing, f"CONTRIBUTING.md's recipes name missing paths: {missing}"
