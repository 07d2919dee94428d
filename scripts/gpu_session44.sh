#!/usr/bin/env bash
# One GPU call for issues 44-46: TE + megatron installed, `pytest -m cuda` in 3 shards, the CPU
# (emulated) tests of the classes under this machine's torch, host time per graphed call, the
# shadow verifier's cost. Carry .te/pkg, .te/prune, .whl. Output: $OUT (few files: logs tarred).
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT" /tmp/w
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
timeout 120 bash .te/pkg/install_on_device.sh prune > /tmp/w/te_install.log 2>&1; echo "te-install rc=$?" >> "$OUT/stages.txt"
# shellcheck disable=SC1091
. /tmp/site/te_env.sh
timeout 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w/megatron_install.log 2>&1; echo "megatron-install rc=$?" >> "$OUT/stages.txt"
export PYTHONPATH="$PWD:$PYTHONPATH"
python -c "import transformer_engine, megatron.core as m; print('te', transformer_engine.__version__, 'megatron-core', m.__version__)" >> "$OUT/env.txt" 2>&1
t0=$SECONDS; timeout ${PYTEST_LIMIT:-300} bash scripts/pytest_shards.sh /tmp/w/pytest 3 > "$OUT/pytest_summary.txt" 2>&1; echo "pytest-cuda rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
t0=$SECONDS; timeout 150 python -m pytest -q -m "not cuda" -p no:cacheprovider -rfE --tb=short ${CPU_TESTS:-tests/test_hf_models.py tests/test_fail_closed_python.py tests/test_reentrant.py} > /tmp/w/pytest_cpu_torch211.log 2>&1; echo "pytest-cpu-torch211 rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
grep -E "^(FAILED|ERROR)|passed|failed" /tmp/w/pytest_cpu_torch211.log | tail -20 > "$OUT/pytest_cpu_torch211.txt"
t0=$SECONDS; timeout 60 python scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3 --out "$OUT" > "$OUT/profile_host.log" 2>&1; echo "profile-host rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
t0=$SECONDS; timeout 80 python scripts/bench_verifier.py --device cuda --steps 200 --repeat 3 --out "$OUT" > /tmp/w/bench_verifier.log 2>&1; echo "bench-verifier rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
tar czf "$OUT/logs.tgz" -C /tmp w
cat "$OUT/stages.txt" "$OUT/pytest_summary.txt" "$OUT/pytest_cpu_torch211.txt" | tail -70
