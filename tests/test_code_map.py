"""CONTRIBUTING.md's code map is true: every path it names exists, and every
module of the package and every top-level folder is in it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Code map"


def _mapped_paths() -> list[str]:
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert text.lstrip().startswith("# "), "CONTRIBUTING.md has no title"
    assert SECTION in text, f"CONTRIBUTING.md has no {SECTION!r} section"
    first_section = text.split("\n## ", 2)[1]
    assert first_section.startswith(SECTION[3:]), "the code map comes first"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def test_every_mapped_path_exists():
    paths = _mapped_paths()
    assert paths, "the code map lists no path"
    missing = [path for path in paths if not (REPO / path.rstrip("/")).exists()]
    assert not missing, f"the code map names paths that do not exist: {missing}"


def test_every_module_and_top_level_folder_is_mapped():
    mapped = {path.rstrip("/") for path in _mapped_paths()}
    modules = {
        str(path.relative_to(REPO))
        for path in (REPO / "keras_selfattn").rglob("*.py")
        if path.name != "__init__.py"
    }
    folders = {
        path.name
        for path in REPO.iterdir()
        if path.is_dir()
        and not path.name.startswith(".")
        and path.name != "build"
        and not path.name.endswith(".egg-info")
        and path.name != "artifacts"
    }
    unmapped = sorted((modules | folders) - mapped)
    assert not unmapped, f"add these to CONTRIBUTING.md's code map: {unmapped}"
