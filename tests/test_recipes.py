"""CONTRIBUTING.md's recipes are true: every path they name exists, and the
score-modification recipe names every module that reads a score
modification."""

import ast
import dataclasses
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


def _recipe(title: str) -> str:
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return section.split(f"### {title}", 1)[1].split("\n### ", 1)[0]


def test_the_score_modification_recipe_names_every_module_reading_one():
    """A module that reads a `ScoreMods` field or property (through a name
    holding "mods") changes with a new score modification: the recipe names
    it."""
    from keras_selfattn.attention.score_mods import ScoreMods

    held = {f.name for f in dataclasses.fields(ScoreMods)} | {
        name for name, value in vars(ScoreMods).items() if isinstance(value, property)
    }
    readers = set()
    for path in sorted(REPO.glob("keras_selfattn/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in held):
                continue
            base = node.value
            name = getattr(base, "id", None) or getattr(base, "attr", None) or ""
            if "mods" in name:
                readers.add(path.relative_to(REPO).as_posix())
    assert len(readers) >= 5, readers
    recipe = _recipe("A score modification")
    assert not [path for path in sorted(readers) if f"`{path}`" not in recipe]
