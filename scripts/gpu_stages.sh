# Sourced by the one-call GPU check (gpu_check.sh, every variant):
# set OUT (default given by the caller as $1), a log in $OUT/log.txt, and `stage NAME SECONDS
# CMD...`, which runs CMD under a time limit, tees it into the log, records its exit code in
# STAGES and keeps going when it fails.
set -o pipefail
OUT="${OUT:-$1}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
: >"$LOG"
declare -a STAGES=()

stage() {
  local name="$1" limit="$2"
  shift 2
  echo "=== [$name] $* (limit ${limit}s) ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=$?
  STAGES+=("$name rc=$rc ($((SECONDS - t0))s)")
  echo "=== [$name] exit $rc after $((SECONDS - t0))s ===" | tee -a "$LOG"
}

# The one-archive checks (final, versions, perf, compiled): every stage writes $W/NAME.log and a
# line "NAME rc=N Ts" in $W/stages.txt; `archive_end` puts a summary in $OUT/summary.txt and
# the whole of $W in $OUT/NAME.tgz (at most 8 files come back from the machine: these two).
archive_begin() {
  W=/tmp/$1 && rm -rf "$W" && mkdir -p "$W"
  { date -u; git log --oneline -1 2>/dev/null
    python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    python -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
  } >"$W/env.txt" 2>&1
}
bounded() {
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$W/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" >>"$W/stages.txt"
}
archive_end() {
  { cat "$W/env.txt" "$W/stages.txt"; [ -f "$W/pytest_cuda.log" ] && tail -n 15 "$W/pytest_cuda.log"
    for f in "$W"/*.md "$W"/*/*.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
    for f in "$W"/profile_host*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^===|per graphed call|step wall|checks alone|forward,|backward,|optimizer step" "$f"; }; done
  } >"$OUT/summary.txt" 2>&1
  tar czf "$OUT/$(basename "$W").tgz" -C /tmp "$(basename "$W")"
  cat "$OUT/summary.txt"
}
pytest_cuda() {  # `pytest -m cuda` in 3 processes (scripts/pytest_shards.sh), the recipes'
  # kill-and-resume tests apart (time); the shards' logs go into the archive
  bounded pytest_cuda "$1" bash scripts/pytest_shards.sh "$W/pytest" 3
}
