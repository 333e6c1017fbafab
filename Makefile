# One entry point. Every target creates its virtualenv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The tested version of every package `make test` and `make demo` install;
# `make lock` rewrites it. pyproject.toml keeps ranges for users.
LOCK := requirements/test.lock
# Constraints beyond pyproject.toml (torch's CPU build), for the lock and for
# the newest-release install alike.
CONSTRAINTS := requirements/constraints.txt
LATEST_VENV := .venv-latest
TOOLS_VENV := .venv-tools
PIP_TOOLS := pip-tools==7.6.2
BACKENDS := tensorflow jax torch
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: install demo test test-slow lint bench bench-peers clean lock test-latest gpu-wheels \
	bench-real-size bench-litert-runtime $(BACKENDS:%=test-%) $(BACKENDS:%=test-slow-%)

# A new virtualenv, git-ignored from the inside (Python < 3.13 does not).
define new_venv
test -x $(1)/bin/python || { $(PYTHON) -m venv $(1) && echo '*' > $(1)/.gitignore; }
$(1)/bin/python -m pip install --quiet --upgrade pip
endef

# Test-only packages installed without their declared dependencies (the
# file says why).
NO_DEPS := requirements/no-deps.txt

# The locked versions, then the package itself built by the locked setuptools.
$(STAMP): pyproject.toml $(LOCK) $(NO_DEPS)
	$(call new_venv,$(VENV))
	$(PY) -m pip install --quiet -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps -r $(NO_DEPS)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/quickstart.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The fast suite on every Keras backend, as parallel processes; each
# backend's output is printed as one block when it ends. Off TensorFlow,
# tests marked tensorflow_only are skipped with their reason (-rs lists them).
test: lint
	$(MAKE) --no-print-directory -j3 --output-sync=target $(BACKENDS:%=test-%)

$(BACKENDS:%=test-%): test-%: install
	@echo "=== KERAS_BACKEND=$* ==="
	KERAS_BACKEND=$* $(PYTEST) -m "not slow"

# The long tests, likewise on every backend. CI's TensorFlow slow suite
# passes SLOW_MARKS="slow and not release" (.ci/run): the tests marked
# `release` (every keras-hub family's SavedModel generator and seeded
# sampling) run here, before a release. SLOW_WORKERS=2 runs a suite's test
# files in two processes (pytest-xdist), as CI's one suite does: the three
# suites of `make test-slow` already share the cores.
SLOW_MARKS ?= slow
SLOW_WORKERS ?=
test-slow: install
	$(MAKE) --no-print-directory -j3 --output-sync=target $(BACKENDS:%=test-slow-%)

$(BACKENDS:%=test-slow-%): test-slow-%: install
	@echo "=== KERAS_BACKEND=$* (slow) ==="
	KERAS_BACKEND=$* KERAS_SELFATTN_XLA_OPTIMIZE=1 $(PYTEST) -m "$(SLOW_MARKS)" \
		$(if $(SLOW_WORKERS),-n $(SLOW_WORKERS) --dist loadfile) \
		|| [ $$? -eq 5 ]  # 5: none collected

# Newest releases allowed by pyproject.toml (and the constraints), no lock,
# in their own virtualenv: a refresh that fails here shows what `make lock`
# would bring in, while main stays on the lock.
test-latest:
	$(call new_venv,$(LATEST_VENV))
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade \
		--upgrade-strategy eager -c $(CONSTRAINTS) -e ".[test]"
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-deps -r $(NO_DEPS)
	touch $(LATEST_VENV)/.installed
	$(MAKE) --no-print-directory test VENV=$(LATEST_VENV)

# Rewrites the lock with the newest versions allowed by pyproject.toml and
# the constraints, resolved by pip-tools with pip's own configuration (its
# indexes and find-links stay out of the file). "Unsafe" keras-selfattn: the
# package itself, which its test extra names, is not pinned.
lock:
	$(call new_venv,$(TOOLS_VENV))
	$(TOOLS_VENV)/bin/python -m pip install --quiet "$(PIP_TOOLS)"
	CUSTOM_COMPILE_COMMAND="make lock" $(TOOLS_VENV)/bin/pip-compile --quiet \
		--upgrade --extra test --strip-extras --unsafe-package keras-selfattn \
		--no-emit-index-url --no-emit-find-links --constraint $(CONSTRAINTS) \
		--output-file $(LOCK) pyproject.toml

bench: install
	$(PY) -m benchmarks.cpu && $(PY) -m benchmarks.runtimes && $(PY) -m benchmarks.serving \
		&& $(PY) -m benchmarks.quantized \
		&& $(PY) -m benchmarks.generation && $(PY) -m benchmarks.nested \
		&& $(foreach b,$(BACKENDS),KERAS_BACKEND=$(b) $(PY) -m benchmarks.keras_hub &&) \
		$(foreach b,$(BACKENDS),KERAS_BACKEND=$(b) $(PY) -m benchmarks.keras_hub_153m &&) \
		$(PY) -m benchmarks.score_mods \
		&& $(PY) -m benchmarks.overhead

# The generators against onnxruntime-genai's own loop on one transformers
# checkpoint (benchmarks/peers.py). onnxruntime-genai, transformers and
# torch's CPU build live in their own virtualenv: not dependencies of the
# package, not part of `make bench` or CI. PEERS_ARGS picks the request
# and the load, e.g. PEERS_ARGS="--batch 8 --busy 2" (`--help`).
PEERS_VENV ?= .venv-peers
PEERS_ARGS ?=
bench-peers: install
	$(call new_venv,$(PEERS_VENV))
	$(PEERS_VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) \
		"onnxruntime-genai==0.18.*" onnx-ir transformers torch tokenizers
	$(PY) -m benchmarks.peers --peers-python $(PEERS_VENV)/bin/python $(PEERS_ARGS)

# keras-hub Llamas past 2 GiB (benchmarks/real_size.py): converted,
# generating and exported to every generator format, peak memory and time
# per step. With TF_ENABLE_ONEDNN_OPTS=0, each format took 6.1-6.4 GiB
# and about 2 minutes a step at 0.6 B, 13.0-13.1 GiB at 1.24 B (2-core
# Intel Xeon, 2026-12-03; docs/export.md); about 15 minutes for all the
# steps of one model. Not in `make bench` or CI.
# REAL_SIZE_MODEL: llama-0.6b, llama-3.2-1b or tiny.
REAL_SIZE_MODEL ?= llama-0.6b
bench-real-size: install
	$(PY) -m benchmarks.real_size --model $(REAL_SIZE_MODEL)

# A LiteRT generator file's memory at run time: LiteRT's Interpreter and
# its CompiledModel with an XNNPACK weight cache (exports the model first).
bench-litert-runtime: install
	$(PY) -m benchmarks.litert_runtime --model $(REAL_SIZE_MODEL)

# Keras and the packages it needs that the GPU machine's image lacks, for
# benchmarks/gpu_session.sh (that machine runs Python 3.12 and fetches
# nothing).
gpu-wheels: install
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl keras==3.15.1 namex==0.1.0 optree==0.20.0

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(TOOLS_VENV) artifacts .pytest_cache .ruff_cache
