"""The README's Python examples run and print what the README says.

Every ```python block runs in a fresh interpreter, except one right after an
`<!-- not run: reason -->` comment (e.g. a client that needs a live server).
A `print(...)  # text` line promises that output.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tensorflow_only(
    "the README's examples export SavedModel and ONNX"
)

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    blocks = re.findall(
        r"(<!-- not run:[^>]*-->\n)?```python\n(.*?)```", README.read_text(), flags=re.S
    )
    return [code for skip, code in blocks if not skip]


def test_readme_python_examples_run_and_print_the_commented_results(tmp_path):
    blocks = _python_blocks()
    assert blocks, "the README has no Python example"
    for block in blocks:
        result = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout.strip().splitlines()
        promised = [
            comment.strip()
            for line in block.splitlines()
            if line.startswith("print(")
            for comment in line.split("#")[1:2]
        ]
        if promised:
            assert printed[-len(promised) :] == promised
