"""A benchmark run as its users run it, for the smoke tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_quick(name: str, out: Path, timeout: int) -> tuple[dict, str]:
    """`python -m benchmarks.NAME --quick --out OUT` in a fresh TensorFlow
    interpreter: its results (OUT/NAME.json) and its table (OUT/NAME.md),
    which must be the table it printed."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
    markdown = (out / f"{name}.md").read_text(encoding="utf-8")
    assert markdown in done.stdout  # the table printed is the table written
    return loaded, markdown
