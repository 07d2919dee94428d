#!/usr/bin/env bash
# Issue 15's GPU check and issue 16's megatron recipe (repository root on the GPU machine; < 9 min):
#   bash scripts/gpu_memory_check.sh        # writes into $OUT (default ./gpu_out)
# Stages: environment; the allocator's trace of capture (tiny, small; fresh process per case);
# the training benchmark's memory at the issue's three configs (eager, make_graphed_callables,
# the whole-step graph, per-layer, full iteration) and recompute (eager and per-layer
# checkpointing at small and medium); megatron's optimizer with and without capturable AdamW
# (60 steps, a one-ulp chaos baseline); the megatron recipe's GPU tests.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_out
mkdir -p "$OUT/mem" "$OUT/ckpt"

stage env 20 bash -c '
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv || true
  python -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python -c "import megatron.core as m; print(\"megatron-core\", m.__version__)" || true'

stage trace 150 python scripts/probe_memory_trace.py --configs tiny,small --out "$OUT/trace.json"

stage bench-mem 200 python scripts/bench_train.py --configs tiny,tiny_b1,small \
  --modes eager,graphed_callables,floor,tgraph_layer,tgraph_full --steps 40 --out "$OUT/mem"

stage bench-ckpt 150 python scripts/bench_train.py --configs small,medium \
  --modes eager,eager_ckpt,tgraph_layer_ckpt --steps 40 --out "$OUT/ckpt"

stage megatron-capturable 90 python scripts/probe_megatron_capturable.py --layers 12 \
  --steps 65 --batches 4 --out "$OUT/megatron_capturable.json"

stage megatron-recipe 150 python -m pytest -q -p no:cacheprovider -rfs -m "cuda" \
  tests/test_megatron_recipe.py

printf '%s\n' "${STAGES[@]}" | tee -a "$LOG"
