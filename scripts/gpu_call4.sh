#!/usr/bin/env bash
# The shortest GPU check: megatron-core installed (carry .whl), its 100-step bitwise test on the
# local spec, and the CUDA tests of the files the last merge touched (two processes).
OUT=${OUT:-./o}; mkdir -p "$OUT"
timeout 40 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1; echo mg=$?
export PYTHONPATH="$PWD:/tmp/site:$PYTHONPATH"
P="python -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short"
MASTER_PORT=29611 timeout 150 $P "tests/test_megatron_optimizer_graph.py" -k "bitwise_over_100_steps and local" > "$OUT/pytest_a.log" 2>&1 &
MASTER_PORT=29612 timeout 150 $P tests/test_segments.py tests/test_hf_integration.py tests/test_reentrant.py tests/test_memory.py > "$OUT/pytest_b.log" 2>&1
wait
for f in pytest_a pytest_b; do echo "== $f"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/$f.log" | tail -12; done
