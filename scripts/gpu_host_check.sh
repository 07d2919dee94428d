#!/usr/bin/env bash
# Issue 25's GPU check (run from the repository root on the GPU machine; < 6 minutes):
#   bash scripts/gpu_host_check.sh             # writes into $OUT (default ./gpu_out)
#   bash scripts/gpu_host_check.sh bench       # the HF Llama benchmark alone (< 5 minutes)
# Stages (limits add up to 350 s): environment; `pytest -m cuda` of the compile and signature
# tests; the host profile (toy and HF Llama, 12 layers, B1) at d256 T128 and host-bound at d32
# T8. `bench`: bench_train.py --hf (the three Llama cells, every mode; JSON written after each
# mode, so a run cut by the limit keeps what it measured). Every stage runs even when an
# earlier one failed; each exit code is recorded.
# Files in $OUT: log.txt, pytest.xml, profile/profile_host.json,
# profile_hostbound/profile_host.json, hf/bench_train.{json,md}.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_out

if [ "${1:-}" = bench ]; then
  stage bench-hf 300 python scripts/bench_train.py --hf --out "$OUT/hf"
else
  stage env 20 bash -c '
    date -u; nvidia-smi --query-gpu=name,driver_version --format=csv || true
    python -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
    git log --oneline -1 2>/dev/null || true'
  stage pytest 120 python -m pytest -q -p no:cacheprovider -rfs -m cuda \
    tests/test_compile.py tests/test_signature.py --junitxml="$OUT/pytest.xml"
  stage profile 120 python scripts/profile_host.py --device cuda --backend cuda \
    --steps 200 --reps 3 --out "$OUT/profile"
  stage profile-hostbound 90 python scripts/profile_host.py --device cuda --backend cuda \
    --n-embd 32 --seq 8 --steps 200 --reps 3 --out "$OUT/profile_hostbound"
fi
printf '%s\n' "${STAGES[@]}" | tee -a "$LOG"
