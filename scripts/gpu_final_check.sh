#!/usr/bin/env bash
# Session 4's closing GPU check (repository root on the GPU machine; < 9 minutes):
#   bash scripts/gpu_final_check.sh        # writes into $OUT (default ./gpu_out)
# Stages: environment; the whole `pytest -m cuda` (megatron and Hugging Face tests included where
# importable); the training benchmark at the memory issue's three configs with the optimizer
# graph (issue 15's memory, issue 16's toy goals); megatron-core with its own optimizer in every
# mode (issue 16's megatron goals); the megatron recipe's four modes; host time per step.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_out
mkdir -p "$OUT/toy" "$OUT/megatron"

stage env 20 bash -c '
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv || true
  python -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python -c "import megatron.core as m; print(\"megatron-core\", m.__version__)" || true'

stage pytest-cuda 220 python -m pytest -m cuda -q -p no:cacheprovider -rf

stage bench-toy 110 python scripts/bench_train.py --configs tiny,tiny_b1,small --steps 60 \
  --modes eager,graphed_callables,floor,tgraph_layer,tgraph_layer_opt,tgraph_full --out "$OUT/toy"

stage bench-megatron 80 python scripts/bench_train.py --configs tiny --steps 60 \
  --modes megatron_opt_none,megatron_opt_none_capturable,megatron_opt_local,megatron_opt_tgraph_layer_opt,megatron_opt_tgraph_full \
  --out "$OUT/megatron"

for g in none layer layer+opt full; do
  stage "recipe-$g" 40 python recipes/train_megatron_gpt.py --graph "$g" --steps 25 \
    --log-every 8 --out "/tmp/meg_$g"
done

if [ -f scripts/profile_host.py ]; then
  stage host 40 python scripts/profile_host.py --device cuda --backend cuda
fi

printf '%s\n' "${STAGES[@]}" | tee -a "$LOG"
