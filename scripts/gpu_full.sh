#!/usr/bin/env bash
# One GPU call that checks a tree whole: TE + megatron installed, `pytest -m cuda` in 4 shards
# beside the emulated (CPU) tests of the classes under this machine's torch, then host time per
# graphed call with and without the module epoch (HF Llama, 12 merged layers). Carry .te/pkg,
# .te/prune, .whl. BENCH=1 adds the HF Llama cells and the toy against the floor (bench_train.py,
# as gpu_check.sh's perf check). Output: $OUT (summaries; every log and JSON in logs.tgz).
# About 4 minutes, 8 with BENCH=1 (HF_MODES: the HF cells' modes; CELLS: the cells, ';'-separated). PROFILES: the host-time scripts to run (default both);
# SHARDS: pytest processes (default 4). TREE: the commit to name in env.txt (the device's .git may be stale).
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT" /tmp/w
{ date -u; git log -1 --format='the device copy of .git: %h (often stale)' 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; echo "tree ${TREE:-unknown}"; } > "$OUT/env.txt" 2>&1
timeout 120 bash .te/pkg/install_on_device.sh prune > /tmp/w/te_install.log 2>&1; echo "te-install rc=$?" >> "$OUT/stages.txt"
# shellcheck disable=SC1091
. /tmp/site/te_env.sh
timeout 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w/megatron_install.log 2>&1; echo "megatron-install rc=$?" >> "$OUT/stages.txt"
export PYTHONPATH="$PWD:$PYTHONPATH"
python -c "import transformer_engine, megatron.core as m; print('te', transformer_engine.__version__, 'megatron-core', m.__version__)" >> "$OUT/env.txt" 2>&1
t0=$SECONDS
OMP_NUM_THREADS=2 MASTER_PORT=29620 timeout ${CPU_LIMIT:-300} python -m pytest -q -m "not cuda" -p no:cacheprovider -rfE --tb=short \
  ${CPU_TESTS:-tests/test_megatron_optimizer_graph.py tests/test_hf_models.py tests/test_fail_closed_python.py tests/test_reentrant.py} \
  > /tmp/w/pytest_cpu_device_torch.log 2>&1 &
cpu=$!
timeout ${PYTEST_LIMIT:-330} bash scripts/pytest_shards.sh /tmp/w/pytest ${SHARDS:-4} -rs > "$OUT/pytest_summary.txt" 2>&1; echo "pytest-cuda rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
wait $cpu; echo "pytest-cpu-device-torch rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
{ echo "== emulated tests under the device's torch"; grep -E "^(FAILED|ERROR)|passed|failed" /tmp/w/pytest_cpu_device_torch.log | tail -20; } >> "$OUT/pytest_summary.txt"
for s in ${PROFILES:-profile_host profile_host_no_epoch}; do
  t0=$SECONDS; mkdir -p "/tmp/w/$s"
  timeout 55 python scripts/$s.py --device cuda --backend cuda --model llama --steps 200 --reps 3 --out "/tmp/w/$s" > "/tmp/w/$s.log" 2>&1
  echo "$s rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"; cp "/tmp/w/$s/profile_host.json" "$OUT/$s.json"
done
if [ "${BENCH:-0}" = 1 ]; then
  modes=${HF_MODES:-eager,graphed_callables,tgraph_layer,tgraph_layer_norm_eager,tgraph_layer_direct,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_direct,tgraph_full}
  IFS=';' read -ra cells <<< "${CELLS:-tiny,tiny_b1 fp32 toy 130;llama_b1,llama_b8 fp32 hf_fp32 105;llama_d1024 bf16 hf_d1024 85}"
  for cell in "${cells[@]}"; do
    set -- $cell; t0=$SECONDS
    m=$modes; [ "$3" = toy ] && m=eager,floor,graphed_callables,tgraph_layer,tgraph_layer_head,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_head,tgraph_model,tgraph_model_opt_noskip,tgraph_full
    steps=10; [ "$3" = toy ] && steps=50
    timeout "$4" python scripts/bench_train.py --configs "$1" --dtypes "$2" --steps $steps --warmup 2 \
      --modes "$m" --out "/tmp/w/$3" > "/tmp/w/bench_$3.log" 2>&1
    echo "bench-$3 rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"; cp /tmp/w/$3/bench_train.md "$OUT/bench_$3.md"
  done
fi
tar czf "$OUT/logs.tgz" -C /tmp w
cat "$OUT/stages.txt" "$OUT/pytest_summary.txt"
[ "${BENCH:-0}" = 1 ] && cat "$OUT"/bench_*.md 2>/dev/null | grep -E "^\|" | head -40
grep -hE "per graphed call|checks_baked|autograd_function|backward:|input_copies|step wall" /tmp/w/profile_host*.log
