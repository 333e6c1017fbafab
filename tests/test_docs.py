"""The documentation's Python examples run, print what they say, and warn of
nothing.

Every ```python block of README.md, CONTRIBUTING.md and docs/*.md runs in a
fresh interpreter on the TensorFlow backend (the examples export SavedModel
and ONNX), except one right after an `<!-- not run: reason -->` comment
(e.g. a client that needs a live server). A `print(...)  # text` line
promises that output; no Python warning may reach stderr. The blocks do not
depend on the suite's backend, so they run in one suite.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(REPO.glob("docs/*.md"))]

pytestmark = pytest.mark.one_suite(
    "each block runs in its own interpreter", slow_suite="tensorflow"
)


def _python_blocks(page: Path) -> list[str]:
    blocks = re.findall(
        r"(<!-- not run:[^>]*-->\n)?```python\n(.*?)```", page.read_text(), flags=re.S
    )
    return [code for skip, code in blocks if not skip]


def _run_block(block: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", block],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "Warning: " in line]
    assert not warned, warned
    printed = result.stdout.strip().splitlines()
    promised = [
        comment.strip()
        for line in block.splitlines()
        if line.startswith("print(")
        for comment in line.split("#")[1:2]
    ]
    if promised:
        assert printed[-len(promised) :] == promised


def test_the_readme_has_an_example():
    assert _python_blocks(REPO / "README.md"), "the README has no Python example"


# Pages whose examples export and verify several artifacts (a minute or
# more each on 2 shared cores): the slow suite.
# migrating.md's keras-hub model generates: 42 s on the AVX2 EPYC; layer.md's
# eight blocks (eight interpreters): 28 s there. README.md's trains, saves
# and loads a model on TensorFlow: 16 s on the AVX-512 EPYC.
SLOW_PAGES = {
    "README.md",
    "decoding.md",
    "export.md",
    "layer.md",
    "migrating.md",
    "quantization.md",
}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.slow) if page.name in SLOW_PAGES else page
        for page in PAGES
    ],
    ids=lambda page: page.name,
)
def test_python_examples_run_and_print_the_commented_results(page, tmp_path):
    for block in _python_blocks(page):
        _run_block(block, tmp_path)
