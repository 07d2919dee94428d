#!/usr/bin/env bash
# The main job: train the toy GPT on the Python standard library's sources, then decode samples
# from the saved checkpoint with graph-served decode.
#
#   bash scripts/quickstart.sh                 # CPU: a few minutes (emulated graphs)
#   bash scripts/quickstart.sh --graph full    # any train_gpt.py flag is passed through
#   OUT=runs/gpu bash scripts/quickstart.sh --steps 2000   # on a GPU: real CUDA graphs
#
# Writes $OUT/{config.json,metrics.jsonl,loss.png,summary.json,checkpoints/}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/quickstart}"
python recipes/train_gpt.py --out "$OUT" "$@"
python recipes/generate.py --ckpt "$OUT/checkpoints/latest" --max-new-tokens 100 --temperature 0.8 --top-k 40 \
    --prompt "# file: json/" --prompt "def " --prompt "class "
