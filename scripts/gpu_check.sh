#!/usr/bin/env bash
# The one-call GPU check (run from the repository root on the GPU machine; each variant < 9 min):
#   bash scripts/gpu_check.sh            # the default check (below)
#   bash scripts/gpu_check.sh decode     # decode tests; decode benchmark with time to first
#                                        # token and a torch.profiler table at batch 1 and 64
#   bash scripts/gpu_check.sh memory     # training memory at tiny, tiny_b1, small; recompute
#                                        # (per-layer checkpointing) at small and medium
#   bash scripts/gpu_check.sh optimizer  # optimizer-graph tests; toy GPT at B8 and B1 and
#                                        # megatron-core with its own optimizer, every mode
#   bash scripts/gpu_check.sh megatron   # the megatron recipe's GPU tests and its four modes
#   bash scripts/gpu_check.sh host       # compile and signature tests; host time per call
#                                        # (toy and HF Llama, 12 layers, B1; also host-bound)
#   bash scripts/gpu_check.sh hf         # bench_train.py --hf (the three Llama cells)
#   bash scripts/gpu_check.sh perf       # the closing check of a tree (also `final`), < 8 min,
#                                        # one archive ($OUT/perf.tgz, $OUT/summary.txt):
#                                        # `pytest -m cuda` (the recipes' kill-and-resume tests
#                                        # apart), HF Llama b1/b8/d1024 without compile, the toy
#                                        # at batch 8 and 1 (each with direct_grads too),
#                                        # host time per call with direct_grads
#   bash scripts/gpu_check.sh direct     # direct_grads beside autograd's path: its CUDA tests,
#                                        # the toy, host per call and per phase, each both ways
#   bash scripts/gpu_check.sh trace      # the GPU's timeline at HF batch 1 and 8 (bench_train
#                                        # --trace): kernel, busy and idle time per step
#   bash scripts/gpu_check.sh versions OLD   # `pytest -m cuda`; the toy benchmark of the tree in
#                                        # OLD and of this one; the HF Llama cells
#   bash scripts/gpu_check.sh compiled  # torch.compile modes beside tgraph on the HF Llama cells
#   bash scripts/gpu_check.sh te         # TE + megatron-core installed, `pytest -m cuda` with both
#                                        # (3 processes), the TE benchmark in bf16 and FP8 (carry
#                                        # .te/pkg, .te/prune and .whl); `te-verify`: the same,
#                                        # then host time per call instead of the TE benchmark
#   bash scripts/gpu_check.sh close      # TE + megatron installed, `pytest -m cuda`, the HF Llama
#                                        # cells, the toy, host per call, per-layer memory by
#                                        # phase (probe_layer_memory.py); one archive (< 9 min)
#   bash scripts/gpu_check.sh verify     # `pytest -m cuda`, then the CPU cases on this machine
#                                        # (the emulated backend where CUDA is present), then
#                                        # host time per call on the GPU (toy and HF Llama)
# Output goes to $OUT (default ./gpu_check_out): log.txt, then each stage's files. Every stage
# runs even when an earlier one failed; each is bounded by `timeout` and its exit code recorded.
#
# Default: environment, `pytest -m cuda`, training benchmark (tiny, fp32, all modes), decode
# benchmark (batch 1/8/64 + mixed workload), plots, then a summary table; stage limits add up to
# 500 s. Files: log.txt, bench_train.{json,md,png}, bench_decode.{json,md,png}.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_check_out
CHECK="${1:-default}"

env_stage() {
  stage env 30 bash -c '
    date -u; uname -a
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi unavailable"
    python -c "import torch, sys; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"gpu\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
    python -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in (\"transformers\", \"megatron\", \"tqdm\", \"safetensors\", \"matplotlib\")})"
    python -c "import megatron.core as m; print(\"megatron-core\", getattr(m, \"__version__\", \"?\"))" 2>/dev/null || true
    git log --oneline -1 2>/dev/null || true'
}

# The HF Llama cells without compile, each in its own dtype, in one process per dtype.
hf_cells() {
  local modes=eager,graphed_callables,tgraph_layer,tgraph_layer_direct,tgraph_layer_opt_noskip
  modes=$modes,tgraph_layer_opt_noskip_direct,tgraph_full
  bounded bench_hf_fp32 80 python scripts/bench_train.py --configs llama_b1,llama_b8 --dtypes fp32 \
    --steps 10 --warmup 2 --modes "$modes" --out "$W/hf_fp32"
  bounded bench_hf_d1024 65 python scripts/bench_train.py --configs llama_d1024 --dtypes bf16 \
    --steps 10 --warmup 2 --modes "$modes" --out "$W/hf_d1024"
}

MEGATRON_OPT_MODES=megatron_opt_none,megatron_opt_none_capturable,megatron_opt_local,megatron_opt_tgraph_layer_opt,megatron_opt_tgraph_full

case "$CHECK" in
default) ;;
versions)
  # Before/after in one call: `pytest -m cuda` on this tree, then the toy training benchmark of
  # an older tree ($2, a directory holding `tgraph/`, e.g. from `git archive REV tgraph | tar -x
  # -C .old`, carried) and of this tree with the same harness, then the HF Llama cells.
  OLD="${2:?versions needs the directory of the older tree}"
  archive_begin versions
  [ "${PYTEST:-1}" = 1 ] && pytest_cuda 200  # PYTEST=0: the benchmarks alone
  BENCH_ARGS="--configs tiny,tiny_b1 --dtypes fp32 --steps 50 --warmup 3 --modes eager,floor,graphed_callables,tgraph_layer,tgraph_full" \
    bounded bench_versions 130 bash scripts/bench_versions.sh "$W" old="$OLD" new="$PWD"
  hf_cells
  archive_end
  exit 0
  ;;
perf | final)
  # `pytest -m cuda`; the three HF Llama cells without compile (batch 1 and 8 fp32, d1024 bf16),
  # the toy at batch 8 and 1 against the hand-written whole step, host time per graphed call.
  # (`final`, the closing check of a tree, is the same check.)
  archive_begin perf
  pytest_cuda 200
  hf_cells
  TOY_MODES=eager,floor,graphed_callables,tgraph_layer,tgraph_layer_direct,tgraph_layer_opt
  bounded bench_toy 50 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 50 \
    --warmup 3 --modes "$TOY_MODES,tgraph_layer_opt_noskip_direct" --out "$W/toy"
  bounded profile_host 35 python scripts/profile_host.py --device cuda --backend cuda --model both \
    --direct on --steps 100 --reps 3 --out "$W/profile"
  archive_end
  exit 0
  ;;
direct)
  # direct_grads beside autograd's path, one process each: its CUDA tests, the toy at batch 1
  # and 8, host time per call and the step's host phases with and without it
  archive_begin direct
  bounded pytest_cuda 60 python -m pytest -m cuda -q -p no:cacheprovider -rf \
    tests/test_direct_grads.py tests/test_gradients.py tests/test_hf_integration.py -k "direct or accumulators or lora_training"
  D_MODES=floor,graphed_callables,tgraph_layer,tgraph_layer_direct,tgraph_layer_opt_noskip
  bounded bench_toy 45 python scripts/bench_train.py --configs tiny_b1,tiny --dtypes fp32 --steps 50 \
    --warmup 3 --modes "$D_MODES,tgraph_layer_opt_noskip_direct" --out "$W/toy"
  bounded profile_host 30 python scripts/profile_host.py --device cuda --backend cuda --model both \
    --steps 100 --reps 3 --out "$W/profile"
  bounded profile_host_direct 30 python scripts/profile_host.py --device cuda --backend cuda \
    --model both --direct on --steps 100 --reps 3 --out "$W/profile_direct"
  archive_end
  exit 0
  ;;
trace)
  # the GPU's timeline per step (kernel, busy and idle time) beside mgc, at batch 1 and 8
  archive_begin trace
  bounded trace_hf 70 python scripts/bench_train.py --configs llama_b1,llama_b8 --dtypes fp32 \
    --steps 5 --warmup 2 --trace 20 --modes graphed_callables,tgraph_layer,tgraph_full --out "$W/trace"
  archive_end
  exit 0
  ;;
compiled)
  # torch.compile beside tgraph on the three HF Llama cells: compile reduce-overhead (the peer),
  # compile default, per-layer graphs over compiled layers, full iteration around a compiled
  # model. Each mode compiles afresh (a bare machine has no inductor cache); JSON is written
  # after every mode, so a stage cut by its limit keeps what it measured.
  archive_begin compiled
  C_MODES=compile,tgraph_full_compiled,tgraph_layer_compiled,tgraph_model_compiled,compile_default,tgraph_layer_opt_compiled
  C_MODES=$C_MODES,tgraph_layer_opt_compiled_direct
  bounded compiled_b1 190 python scripts/bench_train.py --configs llama_b1 --dtypes fp32 \
    --steps 10 --warmup 2 --modes "$C_MODES" --out "$W/c_b1"
  bounded compiled_b8 175 python scripts/bench_train.py --configs llama_b8 --dtypes fp32 \
    --steps 10 --warmup 2 --modes "$C_MODES" --out "$W/c_b8"
  bounded compiled_d1024 210 python scripts/bench_train.py --configs llama_d1024 --dtypes bf16 \
    --steps 10 --warmup 2 --modes "$C_MODES" --out "$W/c_d1024"
  # the optimizer hand-off: per-layer alone against per-layer + OptimizerGraph without and with
  # the non-finite skip (whose gradient norm is one more pass over every gradient), one process
  H_MODES=tgraph_layer,tgraph_layer_opt_noskip,tgraph_layer_opt
  bounded handoff_d1024 40 python scripts/bench_train.py --configs llama_d1024 --dtypes bf16 \
    --steps 10 --warmup 2 --modes "$H_MODES" --out "$W/handoff_d1024"
  bounded handoff_b8 30 python scripts/bench_train.py --configs llama_b8 --dtypes fp32 \
    --steps 10 --warmup 2 --modes "$H_MODES" --out "$W/handoff_b8"
  archive_end
  exit 0
  ;;
close)
  # The closing check of a session, in one archive ($OUT/close.tgz, $OUT/summary.txt): TE and
  # megatron-core installed (carry .te/pkg, .te/prune, .whl), `pytest -m cuda` with both, the
  # HF Llama cells (time and peak memory against eager and mgc), the toy at batch 8 and 1,
  # host time per graphed call.
  stage te-install 120 bash .te/pkg/install_on_device.sh prune
  # shellcheck disable=SC1091
  . /tmp/site/te_env.sh
  stage megatron-install 60 python -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:$PYTHONPATH"
  archive_begin close
  pytest_cuda 230
  hf_cells
  TOY_MODES=eager,floor,graphed_callables,tgraph_layer,tgraph_layer_opt
  bounded bench_toy 50 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 50 \
    --warmup 3 --modes "$TOY_MODES" --out "$W/toy"
  bounded profile_host 35 python scripts/profile_host.py --device cuda --backend cuda --model both \
    --steps 100 --reps 3 --out "$W/profile"
  bounded probe_memory 70 python scripts/probe_layer_memory.py --config llama_d1024 --dtype bf16 \
    --out "$W/probe"
  archive_end
  exit 0
  ;;
te | te-verify | te-megatron)
  # TransformerEngine and megatron-core on a bare machine, then `pytest -m cuda` with both (TE's
  # tests included, in three processes side by side: scripts/pytest_shards.sh), then for `te` the
  # TE benchmark in bf16 and FP8, for `te-verify` host time per call (toy and HF Llama). Carry
  # .te/pkg, .te/prune (../shared/tools/te/stage_local.sh) and .whl (fetch_device_wheels.sh).
  env_stage
  stage te-install 120 bash .te/pkg/install_on_device.sh prune
  # shellcheck disable=SC1091
  . /tmp/site/te_env.sh
  stage megatron-install 60 python -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:$PYTHONPATH"
  stage pytest-cuda 300 bash scripts/pytest_shards.sh "$OUT/pytest" 3
  tar czf "$OUT/pytest.tgz" -C "$OUT" pytest && rm -r "$OUT/pytest"  # 8 files come back at most
  if [ "$CHECK" = te ]; then
    stage bench-te-bf16 100 python scripts/bench_te.py --fp8 none --out "$OUT"
    stage bench-te-fp8 100 python scripts/bench_te.py --fp8 delayed --out "$OUT"
  elif [ "$CHECK" = te-megatron ]; then  # megatron GPTModel with TE's spec, its graphs beside ours
    for f in none delayed; do
      stage "bench-megatron-te-$f" 125 python scripts/bench_megatron_te.py --fp8 $f --layers 4 \
        --hidden 512 --seq 256 --batch 4 --steps 20 --mode-seconds 25 --out "$OUT"
    done
    stage profile-host 45 python scripts/profile_host.py --device cuda --backend cuda \
      --model both --steps 100 --reps 3 --out "$OUT/profile"
  else
    stage profile-host 60 python scripts/profile_host.py --device cuda --backend cuda \
      --model both --steps 200 --reps 3 --out "$OUT/profile"
    stage profile-host-direct 60 python scripts/profile_host.py --device cuda --backend cuda \
      --model both --direct on --steps 200 --reps 3 --out "$OUT/profile_direct"
  fi
  printf '%s\n' "${STAGES[@]}"
  exit 0
  ;;
verify)
  env_stage
  stage pytest-cuda 280 python -m pytest -m cuda -q -p no:cacheprovider -rf
  stage pytest-cpu-cases 150 python -m pytest -m "not cuda" -q -p no:cacheprovider -rf \
    tests/test_emulated_backend.py tests/test_fail_closed.py tests/test_fail_closed_hooks.py \
    tests/test_fail_closed_optim.py tests/test_fail_closed_refusals.py \
    tests/test_hf_integration.py tests/test_optimizer_graph.py tests/test_full_iteration.py
  stage profile-host 60 python scripts/profile_host.py --device cuda --backend cuda \
    --model both --steps 200 --reps 3 --out "$OUT"
  printf '%s\n' "${STAGES[@]}"
  exit 0
  ;;
decode)
  env_stage
  stage pytest-decode 130 python -m pytest -m cuda -q -p no:cacheprovider -rf \
    tests/test_decode.py tests/test_decode_sampling.py tests/test_decode_prefill.py
  stage bench-decode 180 python scripts/bench_decode.py --batches 1,8,64 --steps 100 \
    --prompt-len 32 --hf-batches 1 --no-mixed --ttft-repeats 30 --profile-batch 1,64 --out "$OUT"
  ;;
memory)
  env_stage
  stage bench-mem 200 python scripts/bench_train.py --configs tiny,tiny_b1,small \
    --modes eager,graphed_callables,floor,tgraph_layer,tgraph_full --steps 40 --out "$OUT/mem"
  stage bench-ckpt 150 python scripts/bench_train.py --configs small,medium \
    --modes eager,eager_ckpt,tgraph_layer_ckpt --steps 40 --out "$OUT/ckpt"
  ;;
optimizer)
  env_stage
  stage pytest-optimizer 130 python -m pytest -q -p no:cacheprovider -rfs -m cuda \
    tests/test_optimizer_graph.py --junitxml="$OUT/pytest.xml"
  stage bench-toy 80 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 \
    --steps 100 --warmup 5 --out "$OUT/toy" \
    --modes eager,tgraph_layer,tgraph_layer_opt,tgraph_layer_opt_noskip,tgraph_full,tgraph_full_skip
  stage bench-megatron 110 python scripts/bench_train.py --configs tiny --dtypes fp32 --steps 60 \
    --warmup 5 --out "$OUT/megatron" --modes "$MEGATRON_OPT_MODES"
  ;;
megatron)
  env_stage
  if ! python -c "import megatron.core" 2>/dev/null; then  # a bare machine: the carried wheel
    stage megatron-install 60 python -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  fi
  stage pytest-recipe 150 python -m pytest -q -p no:cacheprovider -rfs -m cuda \
    tests/test_megatron_recipe.py
  for g in none layer layer+opt full; do
    stage "recipe-$g" 40 python recipes/train_megatron_gpt.py --graph "$g" --steps 25 \
      --log-every 8 --out "$OUT/recipe_$g"
  done
  ;;
host)
  env_stage
  stage pytest-host 120 python -m pytest -q -p no:cacheprovider -rfs -m cuda \
    tests/test_compile.py tests/test_signature.py --junitxml="$OUT/pytest.xml"
  stage profile 120 python scripts/profile_host.py --device cuda --backend cuda \
    --steps 200 --reps 3 --out "$OUT/profile"
  stage profile-hostbound 90 python scripts/profile_host.py --device cuda --backend cuda \
    --n-embd 32 --seq 8 --steps 200 --reps 3 --out "$OUT/profile_hostbound"
  ;;
hf)
  # JSON is written after each mode, so a run cut by the limit keeps what it measured.
  stage bench-hf 300 python scripts/bench_train.py --hf --out "$OUT/hf"
  ;;
*)
  echo "unknown check '$CHECK'; expected one of: default final versions perf compiled verify decode memory optimizer megatron host hf te te-verify te-megatron" >&2
  exit 2
  ;;
esac
if [ "$CHECK" != default ]; then
  printf '%s\n' "${STAGES[@]}" | tee -a "$LOG"
  ls -la "$OUT"
  exit 0
fi

env_stage

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
