#!/usr/bin/env bash
# The main job: train the toy GPT on the Python standard library's sources, then decode samples
# from the run's latest checkpoint with graph-served decode.
#
#   bash scripts/quickstart.sh                                # CPU: a few minutes (emulated graphs)
#   bash scripts/quickstart.sh --resume latest --steps 3000   # train the finished run longer
#   bash scripts/quickstart.sh --overwrite                    # discard it and start afresh
#   bash scripts/quickstart.sh --out runs/full --graph full   # any train_gpt.py flag passes through
#   OUT=runs/gpu bash scripts/quickstart.sh --steps 2000      # OUT= sets the run directory too
#   bash scripts/quickstart.sh --help                         # train_gpt.py's flags, then stop
#
# Writes <out>/{config.json,metrics.jsonl,loss.png,summary.json,checkpoints/}, by default under
# runs/quickstart/. A second plain run into a directory that holds a run is refused (one line
# naming --resume latest, an empty or new --out and --overwrite): nothing is overwritten.
# Ctrl-C during training writes a checkpoint of the last finished step and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/quickstart}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do # the run directory: the last --out wins, as in argparse
    case "${args[i]}" in
    --out) OUT="${args[i + 1]:-$OUT}" ;;
    --out=*) OUT="${args[i]#--out=}" ;;
    -h | --help) exec python recipes/train_gpt.py --help ;; # the help only: no run, no samples
    esac
done
python recipes/train_gpt.py --out "$OUT" "$@"
python recipes/generate.py --ckpt "$OUT" --max-new-tokens 100 --temperature 0.8 --top-k 40 \
    --prompt "# file: json/" --prompt "def " --prompt "class "
