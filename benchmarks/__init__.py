"""Benchmarks of keras_selfattn, one module per entry point and per job.

Entry points: `python -m benchmarks.cpu`, `benchmarks.backends`,
`benchmarks.decode`, `benchmarks.runtimes`; `make bench`
runs cpu then runtimes. Shared: `pairs` (the layer pair and FLOP count),
`timing`, `machine`, `probe` (RSS in a child process), `report` (tables,
the JSON file, the command line), `per_backend` (a run once per backend).
"""

import os

# Before any submodule imports TensorFlow: quiet logs, TensorFlow backend.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
