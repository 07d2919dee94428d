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
