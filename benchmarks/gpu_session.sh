#!/usr/bin/env bash
# What a session lent a GPU machine runs there first, as one command of the
# device tool (benchmarks/README.md, "A session lent a GPU"):
#
#   here:   make gpu-wheels        (Keras and the two packages it needs that
#                                   the GPU image lacks, into .whl/)
#   there:  bash benchmarks/gpu_session.sh      with carry [".whl"], timeout 570
#
# The fast suite on JAX and on PyTorch, then `benchmarks.backends` on each,
# every step under its own time limit so the whole stays within 9 minutes of
# device time. Everything lands in $OUT (or /tmp/gpu_session): gpu.txt,
# tests_<backend>.log, backends_<backend>.{log,json}. The GPU image has no
# TensorFlow.
set -uo pipefail
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
	--upgrade --target /tmp/site .whl/*.whl || exit 1
# The suite's XLA flags (tests/conftest.py) are tuned for tiny CPU shapes;
# the GPU keeps XLA's defaults.
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 KERAS_SELFATTN_XLA_OPTIMIZE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
	>"$out/gpu.txt" 2>&1
# Seconds for each step: two suites, then two benchmark runs; the backends
# each step runs (a rerun may leave one out).
TESTS_S=${TESTS_S:-120}
BENCH_S=${BENCH_S:-130}
TEST_BACKENDS=${TEST_BACKENDS:-jax torch}
BENCH_BACKENDS=${BENCH_BACKENDS:-jax torch}
# Arguments of each pytest run; a session may narrow them. The ten test
# modules that import TensorFlow (or TF Serving's protos) at the top fail to
# collect there: the rest runs.
PYTEST_ARGS=${PYTEST_ARGS:-"-m 'not slow' --continue-on-collection-errors"}
for backend in $TEST_BACKENDS; do
	eval "KERAS_BACKEND=$backend timeout $TESTS_S python3 -m pytest -q -rfE \
		-p no:cacheprovider $PYTEST_ARGS" >"$out/tests_$backend.log" 2>&1
	echo "tests $backend: exit $? (124: stopped at ${TESTS_S}s)" | tee -a "$out/gpu.txt"
	tail -n 3 "$out/tests_$backend.log"
done
for backend in $BENCH_BACKENDS; do
	KERAS_BACKEND=$backend timeout "$BENCH_S" python3 -m benchmarks.backends --repeats 5 \
		--json "$out/backends_$backend.json" >"$out/backends_$backend.log" 2>&1
	echo "backends $backend: exit $? (124: stopped at ${BENCH_S}s)" | tee -a "$out/gpu.txt"
done
