#!/usr/bin/env bash
# The shortest GPU check of a tree (no TE, no megatron): the CUDA twins of the per-layer parity,
# fail-closed, edge-case and whole-model tests and of the toy recipe's graph modes (two pytest
# processes), the capture-path probe of HF Llama's step, host time per graphed call (HF Llama,
# per-layer and whole), the toy against the floor in every graph mode; with HF=1 also HF Llama's
# goal cells (batch 1 and 8, fp32; HF_CELLS may name cell:dtype), each cell in one process. Stages: PYTEST, PROBE, PROFILE,
# TOY, HF (1 runs it). Output: $OUT/summary.txt and $OUT/gpu_short.tgz (every log, JSON and
# table; the device call brings back at most 8 files).
FINAL=${OUT:-./gpu_out}; OUT=/tmp/gpu_short; rm -rf "$OUT"; mkdir -p "$FINAL" "$OUT" /tmp/w
export PYTHONPATH="$PWD:$PYTHONPATH"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "tree ${TREE:-unknown}"; } > "$OUT/env.txt" 2>&1
pt() { timeout ${PYTEST_LIMIT:-240} python -m pytest -q -m cuda -p no:cacheprovider -rfEs --tb=short "$@"; }
if [ "${PYTEST:-1}" = 1 ]; then
  pt tests/test_layer_parity.py tests/test_fail_closed_python.py tests/test_layer_edge_cases.py \
    tests/test_api.py tests/test_stack_shortcut.py \
    "tests/test_train_recipe.py::test_graph_modes_train_the_same_parameters" > "$OUT/pytest_a.log" 2>&1 &
  pt tests/test_hf_whole.py tests/test_host_syncs.py tests/test_mutated_inputs.py tests/test_direct_grads.py tests/test_memory.py "tests/test_hf_integration.py::test_family_training_matches_eager" \
    "tests/test_hf_integration.py::test_family_whole_model_training_matches_eager" > "$OUT/pytest_b.log" 2>&1 &
  wait; echo "pytest done" >> "$OUT/env.txt"
fi
if [ "${PROBE:-1}" = 1 ]; then
  timeout 90 python scripts/probe_hf_mask_path.py --out "$OUT/probe_hf_mask_path.json" > "$OUT/probe.log" 2>&1
  echo "probe rc=$?" >> "$OUT/env.txt"
fi
if [ "${PROFILE:-1}" = 1 ]; then
  for w in "" --whole; do
    timeout 60 python scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3 $w \
      --out /tmp/w/p$w > "$OUT/profile_host$w.log" 2>&1
    echo "profile $w rc=$?" >> "$OUT/env.txt"; cp /tmp/w/p$w/profile_host.json "$OUT/profile_host$w.json" 2>/dev/null
  done
fi
if [ "${TOY:-1}" = 1 ]; then
  timeout 150 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 50 --warmup 2 \
    --modes eager,floor,graphed_callables,tgraph_layer,tgraph_layer_head,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_head,tgraph_model,tgraph_model_opt_noskip,tgraph_full \
    --out "$OUT/toy" > "$OUT/bench_toy.log" 2>&1
  echo "bench toy rc=$?" >> "$OUT/env.txt"
fi
if [ "${HF:-0}" = 1 ]; then
  for spec in ${HF_CELLS:-llama_b1 llama_b8}; do  # a cell, or cell:dtype (llama_d1024:bf16)
    cell=${spec%%:*}; dtype=fp32; [ "$cell" != "$spec" ] && dtype=${spec#*:}
    timeout ${HF_LIMIT:-240} python scripts/bench_train.py --configs $cell --dtypes $dtype --steps 20 --warmup 2 \
      --modes ${HF_MODES:-eager,graphed_callables,tgraph_layer,tgraph_layer_opt_noskip_direct,tgraph_model,tgraph_model_opt_noskip,tgraph_full,compile,tgraph_layer_compiled,tgraph_model_compiled,tgraph_full_compiled} \
      --out "$OUT/$cell" > "$OUT/bench_$cell.log" 2>&1
    echo "bench $cell rc=$?" >> "$OUT/env.txt"
  done
fi
{ cat "$OUT/env.txt"; grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT"/pytest_*.log 2>/dev/null | tail -40
  cat "$OUT/probe_hf_mask_path.json" 2>/dev/null
  grep -hE "^\|" "$OUT"/*/bench_train.md 2>/dev/null
  grep -hE -A9 "per graphed call|head's checks" "$OUT"/profile_host*.log 2>/dev/null | head -40
} > "$FINAL/summary.txt"
tar czf "$FINAL/gpu_short.tgz" -C /tmp gpu_short
cat "$FINAL/summary.txt"
