#!/usr/bin/env bash
# One-call GPU check (run from the repository root on the GPU machine; < 9 minutes):
#   bash scripts/gpu_check.sh            # writes into $OUT (default ./gpu_check_out)
# Stage limits add up to 500 s (8.3 min). Stages: environment, `pytest -m cuda`, training benchmark (tiny, fp32, all modes), decode
# benchmark (batch 1/8/64 + mixed workload), plots, then a summary table. Every stage runs even
# when an earlier one failed; each is bounded by `timeout` and its exit code is recorded.
# Files in $OUT (7, flat): log.txt, bench_train.{json,md,png}, bench_decode.{json,md,png}.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_check_out

stage env 30 bash -c '
  date -u; uname -a
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi unavailable"
  python -c "import torch, sys; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"gpu\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  python -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in (\"transformers\", \"megatron\", \"tqdm\", \"safetensors\", \"matplotlib\")})"
  git log --oneline -1 2>/dev/null || true'

stage pytest-cuda 200 python -m pytest -m cuda -q -p no:cacheprovider -rf

# compile last: a cold inductor cache may be slow; results are written after every mode, so a
# time limit only loses the mode it interrupts.
stage bench-train 160 python scripts/bench_train.py --configs tiny --dtypes fp32 --steps 100 \
  --warmup 5 --out "$OUT" \
  --modes eager,floor,graphed_callables,tgraph_layer,tgraph_full,megatron_none,megatron_local,compile

stage bench-decode 110 python scripts/bench_decode.py --batches 1,8,64 --steps 100 --out "$OUT"

stage plot 20 python scripts/plot_bench.py "$OUT/bench_train.json" "$OUT/bench_decode.json" --out "$OUT"

{
  echo "=== summary ==="
  printf '%s\n' "${STAGES[@]}"
  python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError) as exc:
        print(f"{name}: not available ({exc})")
        return None

t = load("bench_train.json")
if t:
    env = t["meta"]["env"]
    print(f"{env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} cuda {env.get('cuda')}")
    print(f"{'train mode':<20}{'ms/step':>9}{'x floor':>9}{'x eager':>9}{'peak MiB':>10}{'capture s':>10}  parity / status")
    for r in t["results"]:
        f = lambda k, d=2: "-" if r.get(k) is None else f"{r[k]:.{d}f}"
        tail = r.get("parity") if r["status"] == "ok" else f"{r['status']}: {r['reason'][:70]}"
        print(f"{r['mode']:<20}{f('ms_median'):>9}{f('ratio_floor'):>9}{f('ratio_eager'):>9}"
              f"{f('peak_mem_mib', 0):>10}{f('capture_s'):>10}  {tail}")
d = load("bench_decode.json")
if d:
    print(f"{'decode':<12}{'mode':<24}{'ms/step':>9}{'tok/s':>10}{'waste':>7}  agreement / status")
    for r in d["results"]:
        f = lambda k, d=2: "-" if r.get(k) is None else f"{r[k]:.{d}f}"
        tail = f("token_agreement", 3) if r["status"] == "ok" else f"{r['status']}: {r['reason'][:60]}"
        print(f"{r['workload']:<12}{r['mode']:<24}{f('ms_median', 3):>9}{f('tokens_per_s', 0):>10}"
              f"{f('padding_waste'):>7}  {tail}")
EOF
  ls -la "$OUT"
} 2>&1 | tee -a "$LOG"
