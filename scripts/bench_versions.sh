#!/usr/bin/env bash
# Benchmark the training step of several checkouts of tgraph with the same harness, one process
# per tree (a refactor's before/after, a guard's cost):
#   bash scripts/bench_versions.sh OUT NAME=PATH [NAME=PATH ...]
# PATH is a directory holding a `tgraph/` package (e.g. `git archive <rev> tgraph | tar -x -C d`);
# writes OUT/bench_<NAME>.json and .md. Extra options go in BENCH_ARGS.
set -uo pipefail
out="$1"; shift
mkdir -p "$out"
args=${BENCH_ARGS:---configs tiny --dtypes fp32 --steps 100 --warmup 5 --modes eager,floor,graphed_callables,tgraph_layer,tgraph_full}
for spec in "$@"; do
  name="${spec%%=*}"; tree="${spec#*=}"
  echo "=== $name ($tree) ==="
  PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python scripts/bench_train.py $args --out "$out/$name" \
    && mv "$out/$name/bench_train.json" "$out/bench_$name.json" \
    && mv "$out/$name/bench_train.md" "$out/bench_$name.md" && rm -rf "${out:?}/$name"
done
