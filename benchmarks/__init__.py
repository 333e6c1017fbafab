"""Benchmarks of keras_selfattn: `make bench` (`python -m benchmarks.run`)."""

import os

# Before any submodule imports TensorFlow: quiet logs, TensorFlow backend.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
