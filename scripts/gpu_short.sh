#!/usr/bin/env bash
# The shortest GPU check of a tree (no TE, no megatron; about 5 minutes, HF=1 about 8): the CUDA twins of the
# per-layer parity, fail-closed and edge-case tests and of the toy recipe's graph modes, the toy
# against the floor in every graph mode (whole-model units included), host time per graphed
# call (HF Llama); with HF=1 also HF Llama's goal cells (batch 1 and 8, fp32) in the modes the
# speed goals name, each cell in one process. Output: $OUT.
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT" /tmp/w
export PYTHONPATH="$PWD:$PYTHONPATH"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "tree ${TREE:-unknown}"; } > "$OUT/env.txt" 2>&1
[ "${PYTEST:-1}" = 1 ] && timeout ${PYTEST_LIMIT:-200} python -m pytest -q -m cuda -p no:cacheprovider -rfEs --tb=short tests/test_layer_parity.py \
  tests/test_fail_closed_python.py tests/test_layer_edge_cases.py tests/test_direct_grads.py tests/test_api.py \
  tests/test_stack_shortcut.py "tests/test_hf_integration.py::test_family_training_matches_eager" \
  "tests/test_train_recipe.py::test_graph_modes_train_the_same_parameters" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/env.txt"
[ "${TOY:-1}" = 1 ] && timeout 120 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 50 --warmup 2 \
  --modes eager,floor,graphed_callables,tgraph_layer,tgraph_layer_head,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_head,tgraph_model,tgraph_model_opt_noskip,tgraph_full \
  --out "$OUT/toy" > /tmp/w/bench.log 2>&1
echo "bench rc=$?" >> "$OUT/env.txt"
timeout 45 python scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3 \
  --out /tmp/w > "$OUT/profile_host.log" 2>&1
echo "profile rc=$?" >> "$OUT/env.txt"; cp /tmp/w/profile_host.json "$OUT/" 2>/dev/null
if [ "${HF:-0}" = 1 ]; then
  for cell in ${HF_CELLS:-llama_b1 llama_b8}; do
    timeout ${HF_LIMIT:-100} python scripts/bench_train.py --configs $cell --dtypes fp32 --steps 20 --warmup 2 \
      --modes ${HF_MODES:-eager,graphed_callables,tgraph_layer,tgraph_layer_norm_eager,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_direct,tgraph_full,compile,tgraph_layer_compiled,tgraph_full_compiled} \
      --out "$OUT/$cell" > "$OUT/bench_$cell.log" 2>&1
    echo "bench $cell rc=$?" >> "$OUT/env.txt"
  done
fi
cat "$OUT/env.txt"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -12
grep -hE "^\|" "$OUT"/*/bench_train.md 2>/dev/null
grep -hE -A9 "per graphed call|head's checks" "$OUT/profile_host.log" | head -24
