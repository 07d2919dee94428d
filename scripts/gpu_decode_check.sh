#!/usr/bin/env bash
# Decode check for issue 18 on one GPU (run from the repository root; about 4 minutes on an H200,
# stage limits add up to 330 s):
#   OUT=./gpu_out bash scripts/gpu_decode_check.sh
# Stages: environment; `pytest -m cuda` of the decode tests (graphs == eager, seeded sampling
# across slots/buckets/company, prefill graphs == eager prefill); the decode benchmark at batch
# 1, 8 and 64 (prompt 32, 100 steps; hand-written graph, engine eager/graphs/no-lookahead/
# sampled, HF generate at batch 1; time to first token with and without prefill graphs; peak
# memory per mode) and a torch.profiler table at batch 1 and 64; then the goals table.
# Every stage runs even when an earlier one failed; each is bounded by `timeout`.
# Files in $OUT: log.txt, bench_decode.{json,md}, bench_decode_profile.txt.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_out

stage env 20 bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi unavailable"
  python -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())"
  git log --oneline -1 2>/dev/null || true'

stage pytest-cuda 130 python -m pytest -m cuda -q -p no:cacheprovider -rf \
  tests/test_decode.py tests/test_decode_sampling.py tests/test_decode_prefill.py

stage bench-decode 180 python scripts/bench_decode.py --batches 1,8,64 --steps 100 \
  --prompt-len 32 --hf-batches 1 --no-mixed --ttft-repeats 30 --profile-batch 1,64 --out "$OUT"

{
  echo "=== summary ==="
  printf '%s\n' "${STAGES[@]}"
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

try:
    d = json.loads((Path(sys.argv[1]) / "bench_decode.json").read_text())
except (OSError, ValueError) as exc:
    sys.exit(f"bench_decode.json: not available ({exc})")
print(f"{'workload':<18}{'mode':<28}{'ms':>9}{'x hand':>8}{'hf x':>7}{'peak MiB':>10}  status")
for r in d["results"]:
    f = lambda k, n=2: "-" if r.get(k) is None else f"{r[k]:.{n}f}"
    x = r.get("x_hand_graph", r.get("x_ttft_prefill_eager"))
    x = "-" if x is None else f"{x:.3f}"
    print(f"{r['workload']:<18}{r['mode']:<28}{f('ms_median', 3):>9}{x:>8}{f('hf_speedup', 1):>7}"
          f"{f('peak_mem_mib', 0):>10}  {r['status']} {r.get('reason', '')[:60]}")
print("goals:")
for k, (value, met) in d.get("goals", {}).items():
    print(f"  {'MET ' if met else 'MISS'} {k}: {value}")
PY
  ls -la "$OUT"
} 2>&1 | tee -a "$LOG"
