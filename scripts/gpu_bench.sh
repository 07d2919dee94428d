#!/usr/bin/env bash
# The speed figures of a tree in one GPU call (about 8 minutes): host time per graphed call
# against an older tree unpacked in .old/ (carry it: `git archive <commit> tgraph scripts | tar -x
# -C .old`), alternated, then the toy against the floor and HF Llama's goal cells, each cell in
# one process. TREE / OLD: the commits to name in env.txt; HF_CELLS= (empty): no HF Llama
# cells; TOY_MODES, HF_MODES, D1024_MODES, AB_REPS; PYTEST_FILES: `pytest -m cuda` of those
# first (2 processes). Output: $OUT (few files: a call brings back about 8).
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT" /tmp/w
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "tree ${TREE:-unknown} old ${OLD:-none}"; } > "$OUT/env.txt" 2>&1
if [ -n "${PYTEST_FILES:-}" ]; then  # CUDA tests first, the files dealt to 2 processes
  i=0; for f in $PYTEST_FILES; do echo "$f" >> "/tmp/w/shard$((i++ % 2))"; done
  for s in 0 1; do
    # shellcheck disable=SC2046
    timeout "${PYTEST_LIMIT:-170}" python -m pytest -m cuda -q -p no:cacheprovider -rfE --tb=short \
      $(cat "/tmp/w/shard$s") > "$OUT/pytest$s.log" 2>&1 &
  done
  wait
fi
prof="scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3"
for i in $(seq ${AB_REPS:-2}); do  # AB_REPS=0: no host profile
  if [ -d .old/tgraph ]; then
    (cd .old && PYTHONPATH=$PWD timeout 50 python $prof --out /tmp/w/old$i > "$OUT/profile_old$i.log" 2>&1)
    cp /tmp/w/old$i/profile_host.json "$OUT/profile_old$i.json" 2>/dev/null
  fi
  PYTHONPATH=$PWD timeout 50 python $prof --out /tmp/w/new$i > "$OUT/profile_new$i.log" 2>&1
  cp /tmp/w/new$i/profile_host.json "$OUT/profile_new$i.json" 2>/dev/null
done
export PYTHONPATH="$PWD:$PYTHONPATH"
run() {  # configs dtype name limit steps modes
  timeout "$4" python scripts/bench_train.py --configs "$1" --dtypes "$2" --steps "$5" --warmup 2 \
    --modes "$6" --out "/tmp/w/$3" > "/tmp/w/bench_$3.log" 2>&1
  echo "bench $3 rc=$?" >> "$OUT/env.txt"; tail -3 "/tmp/w/bench_$3.log" >> "$OUT/env.txt"
  cp "/tmp/w/$3/bench_train.json" "$OUT/bench_$3.json" 2>/dev/null
}
[ "${TOY:-1}" = 1 ] && run tiny,tiny_b1 fp32 toy 110 50 ${TOY_MODES:-eager,floor,graphed_callables,tgraph_layer,tgraph_layer_head,tgraph_layer_opt_noskip,tgraph_layer_opt_noskip_head,tgraph_model,tgraph_full}
hf=${HF_MODES:-eager,graphed_callables,tgraph_layer,tgraph_layer_norm_eager,tgraph_layer_opt_noskip_direct,tgraph_full,compile,tgraph_layer_compiled,tgraph_full_compiled}
for cell in ${HF_CELLS-llama_b1 llama_b8}; do run $cell fp32 $cell ${HF_LIMIT:-100} 20 $hf; done
[ "${D1024:-1}" = 1 ] && run llama_d1024 bf16 d1024 ${D1024_LIMIT:-70} 10 ${D1024_MODES:-eager,tgraph_layer,tgraph_layer_opt_noskip}

cat "$OUT/env.txt"; grep -h "per graphed call" "$OUT"/profile_*.log
grep -hE "^\|" /tmp/w/*/bench_train.md 2>/dev/null
grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT"/pytest*.log 2>/dev/null
