#!/usr/bin/env bash
# A short GPU call: TE + megatron installed; the CUDA tests of the files the last merges touched
# (two processes side by side); the megatron CPU tests under this machine's torch; host time per
# graphed call (HF Llama, 12 merged layers). Carry .te/pkg, .te/prune, .whl. Output: $OUT.
OUT=${OUT:-./o}; mkdir -p /tmp/w "$OUT"
timeout 120 bash .te/pkg/install_on_device.sh prune > /tmp/w/te.log 2>&1; echo te=$?
# shellcheck disable=SC1091
. /tmp/site/te_env.sh
timeout 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w/mg.log 2>&1; echo mg=$?
export PYTHONPATH="$PWD:$PYTHONPATH"
P="python -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short"
MASTER_PORT=29611 timeout 230 $P tests/test_megatron_optimizer_graph.py tests/test_memory.py > "$OUT/pytest_a.log" 2>&1 &
MASTER_PORT=29612 timeout 230 $P tests/test_segments.py tests/test_hf_integration.py tests/test_reentrant.py \
  tests/test_fail_closed_python.py "tests/test_train_hf_recipe.py::test_full_graph_replays_train_as_eager" > "$OUT/pytest_b.log" 2>&1
wait
timeout 90 python -m pytest -q -m "not cuda" -p no:cacheprovider --tb=short tests/test_megatron_optimizer_graph.py > "$OUT/pytest_megatron_cpu.log" 2>&1; echo cpu=$?
timeout 70 python scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3 --out "$OUT" > "$OUT/profile_host.log" 2>&1; echo prof=$?
for f in pytest_a pytest_b pytest_megatron_cpu; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.log" | tail -12; done
grep -E "per graphed call|checks_baked|autograd_function|backward:|input_copies|step wall|stubbed out:|fail-closed" "$OUT/profile_host.log"
