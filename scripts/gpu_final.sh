#!/usr/bin/env bash
# One GPU call that checks a tree end to end in under 8 minutes: `pytest -m cuda` (the recipes'
# kill-and-resume tests apart), the HF Llama training cell at batch 1, the toy at batch 8 and 1,
# and host time per graphed call. Everything lands in $OUT/final.tgz plus $OUT/summary.txt.
set -o pipefail
R="${OUT:?set OUT}"
W=/tmp/final && rm -rf "$W" && mkdir -p "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u; git log --oneline -1 2>/dev/null
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
  python -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
} >"$W/env.txt" 2>&1
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$W/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" >>"$W/stages.txt"; }
stage pytest_cuda 270 python -m pytest -m cuda -q -p no:cacheprovider -rf \
  --ignore=tests/test_train_recipe.py --junitxml="$W/pytest_cuda.xml"
stage bench_hf 110 python scripts/bench_train.py --configs llama_b1 --dtypes fp32 --steps 10 \
  --warmup 2 --modes eager,graphed_callables,tgraph_layer,tgraph_layer_opt,tgraph_full,compile \
  --out "$W/hf"
stage bench_toy 55 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 50 \
  --warmup 3 --modes eager,floor,graphed_callables,tgraph_layer,tgraph_layer_opt --out "$W/toy"
stage profile_host 35 python scripts/profile_host.py --device cuda --backend cuda --model both \
  --steps 100 --reps 3 --out "$W/profile"
{ cat "$W/env.txt" "$W/stages.txt"; tail -n 15 "$W/pytest_cuda.log"
  for f in "$W"/hf/*.md "$W"/toy/*.md; do [ -f "$f" ] && cat "$f"; done
  grep -E "^===|per graphed call|step wall|checks alone" "$W/profile_host.log"; } >"$R/summary.txt" 2>&1
tar czf "$R/final.tgz" -C /tmp final
cat "$R/summary.txt"
