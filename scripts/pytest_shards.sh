#!/usr/bin/env bash
# `pytest -m cuda` in N processes side by side on the one GPU: the test files are dealt
# round-robin, largest first; each shard writes DIR/shardI.log. Extra
# arguments go to every pytest; FILES (space-separated test files) limits the run to them. Exit code: the worst shard's. One process needs more than 330 s
# for the whole suite on the H200 machine; three fit in about half that.
#   bash scripts/pytest_shards.sh DIR N [pytest args...]
dir=$1 n=$2
shift 2
mkdir -p "$dir"
# shellcheck disable=SC2086
files=$(ls -S ${FILES:-tests/test_*.py} | grep -v -e test_train_recipe.py)
pids=()
for ((i = 0; i < n; i++)); do
  mine=$(echo "$files" | awk -v n="$n" -v i="$i" 'NR % n == i')
  # shellcheck disable=SC2086
  # each shard its own rendezvous port (megatron's tests and recipe runs bind MASTER_PORT)
  MASTER_PORT=$((29600 + i)) python -m pytest -m cuda -q -p no:cacheprovider -rfE --tb=short --durations=5 "$@" \
    $mine >"$dir/shard$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  wait "$p" || { r=$?; [ "$r" -gt "$rc" ] && rc=$r; }
done
for ((i = 0; i < n; i++)); do echo "== shard $i"; grep -E "^(FAILED|ERROR)|passed|failed" "$dir/shard$i.log" | tail -n 30; done
exit "$rc"
