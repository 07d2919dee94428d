#!/usr/bin/env bash
# One GPU call for issue 44's work: TE + megatron installed, `pytest -m cuda` in 3 shards, the
# channels_last probe, the shadow verifier's cost. Carry .te/pkg, .te/prune, .whl. Output: $OUT.
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
timeout 120 bash .te/pkg/install_on_device.sh prune > "$OUT/te_install.log" 2>&1; echo "te-install rc=$?" >> "$OUT/stages.txt"
# shellcheck disable=SC1091
. /tmp/site/te_env.sh
timeout 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$OUT/megatron_install.log" 2>&1; echo "megatron-install rc=$?" >> "$OUT/stages.txt"
export PYTHONPATH="$PWD:$PYTHONPATH"
python -c "import transformer_engine, megatron.core as m; print('te', transformer_engine.__version__, 'megatron-core', m.__version__)" >> "$OUT/env.txt" 2>&1
t0=$SECONDS; timeout ${PYTEST_LIMIT:-310} bash scripts/pytest_shards.sh "$OUT/pytest" 3 > "$OUT/pytest_summary.txt" 2>&1; echo "pytest-cuda rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
t0=$SECONDS; timeout 60 python scripts/probe_channels_last.py > "$OUT/probe_channels_last.log" 2>&1; echo "probe rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
t0=$SECONDS; timeout 100 python scripts/bench_verifier.py --device cuda --steps 200 --repeat 3 --out "$OUT" > "$OUT/bench_verifier.log" 2>&1; echo "bench-verifier rc=$? $((SECONDS-t0))s" >> "$OUT/stages.txt"
cat "$OUT/stages.txt" "$OUT/pytest_summary.txt" | tail -60
