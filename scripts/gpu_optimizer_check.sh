#!/usr/bin/env bash
# Issue 16's GPU check (run from the repository root on the GPU machine; < 6 minutes):
#   bash scripts/gpu_optimizer_check.sh        # writes into $OUT (default ./gpu_out)
# Stages (limits add up to 330 s): environment; `pytest -m cuda` of the optimizer-graph tests
# (megatron-core's optimizer included: `-m megatron` runs when megatron.core imports);
# set_sync_debug_mode("error") over 20 replays; the toy-GPT benchmark at B8 and B1 (per-layer +
# optimizer graph vs full iteration); the megatron-core harness with megatron's own optimizer;
# then goals.json. Every stage runs even when an earlier one failed; each exit code is recorded.
# Files in $OUT: log.txt, pytest.xml, sync_debug.json, toy/bench_train.{json,md},
# megatron/bench_train.{json,md}, goals.json.
source "$(dirname "$0")/gpu_stages.sh" ./gpu_out
mkdir -p "$OUT/toy" "$OUT/megatron"

stage env 20 bash -c '
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv || true
  python -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  python -c "import megatron.core as m; print(\"megatron-core\", getattr(m, \"__version__\", \"?\"))" || echo "megatron-core not importable"
  git log --oneline -1 2>/dev/null || true'

stage pytest 130 python -m pytest -q -p no:cacheprovider -rfs -m cuda \
  tests/test_optimizer_graph.py --junitxml="$OUT/pytest.xml"

stage sync-debug 50 python - "$OUT/sync_debug.json" <<'EOF'
"""set_sync_debug_mode("error") over 20 replays: optimizer graph alone, the whole per-layer +
optimizer-graph step, FullIterationGraph(skip_nonfinite=True); toy GPT tiny, B8."""
import json, sys, torch, tgraph
from tgraph.toy.gpt import GPT, GPTConfig

def check(name, step, prepare=lambda i: None, n=20):
    """prepare(i) runs in the default mode, step(i) under set_sync_debug_mode("error")."""
    i = 0
    try:
        for i in range(n):
            prepare(i)
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(i)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return {"case": name, "replays": n, "silent": True}
    except Exception as exc:  # the first sync raises here
        return {"case": name, "replays": i, "silent": False, "error": f"{type(exc).__name__}: {exc}"[:500]}

torch.manual_seed(0)
cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=12, n_head=4, n_embd=256)
x = torch.randint(0, 1024, (8, 128), device="cuda"); y = torch.randint(0, 1024, (8, 128), device="cuda")
results = []
model = GPT(cfg).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
graph = tgraph.OptimizerGraph(opt, clip_grad_norm=1.0)
tgraph.enable(model)
def layer_opt_step(i):
    loss = model(x, y)[1]; loss.backward(); graph.step(loss)
layer_opt_step(0); tgraph.create_graphs(); layer_opt_step(1)  # eager (state), then the capture
assert graph.captured, "the optimizer graph must be captured before the sync check"
held = {}
def fwd_bwd(i):
    held["loss"] = model(x, y)[1]; held["loss"].backward()
results.append(check("optimizer graph replays", lambda i: graph.step(held["loss"]), fwd_bwd))
results.append(check("per-layer graphs + optimizer graph, whole step", layer_opt_step))
tgraph.reset(); tgraph.disable(model)
model2 = GPT(cfg).cuda()
opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, fused=True, capturable=True)
def fn(batch):
    opt2.zero_grad(set_to_none=True); loss = model2(*batch)[1]; loss.backward()
    torch.nn.utils.clip_grad_norm_(model2.parameters(), 1.0); opt2.step(); return loss.detach()
full = tgraph.FullIterationGraph(fn, warmup_steps=3, skip_nonfinite=True)
for _ in range(4):
    full((x, y))
results.append(check("FullIterationGraph(skip_nonfinite=True) replays", lambda i: full((x, y))))
print(json.dumps(results, indent=1))
json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "results": results},
          open(sys.argv[1], "w"), indent=1)
EOF

stage bench-toy 80 python scripts/bench_train.py --configs tiny,tiny_b1 --dtypes fp32 --steps 100 \
  --warmup 5 --out "$OUT/toy" \
  --modes eager,tgraph_layer,tgraph_layer_opt,tgraph_layer_opt_noskip,tgraph_full,tgraph_full_skip

stage bench-megatron 110 python scripts/bench_train.py --configs tiny --dtypes fp32 --steps 60 \
  --warmup 5 --out "$OUT/megatron" \
  --modes megatron_opt_none,megatron_opt_none_capturable,megatron_opt_local,megatron_opt_tgraph_layer_opt,megatron_opt_tgraph_full

{
  echo "=== summary ==="
  printf '%s\n' "${STAGES[@]}"
  python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(sub):
    try:
        return {(r["config"], r["mode"]): r for r in json.loads((out / sub / "bench_train.json").read_text())["results"]}
    except (OSError, ValueError) as exc:
        print(f"{sub}: no results ({exc})"); return {}
def ms(table, cfg, mode):
    r = table.get((cfg, mode)); return r.get("ms_median") if r and r["status"] == "ok" else None
def ratio(a, b):
    return None if a is None or b is None else round(a / b, 3)
toy, meg = rows("toy"), rows("megatron")
for table in (toy, meg):
    for (cfg, mode), r in table.items():
        tail = r.get("parity") if r["status"] == "ok" else f"{r['status']}: {r['reason'][:80]}"
        print(f"{cfg:<8}{mode:<32}{r.get('ms_median') or float('nan'):>9.3f} ms  {tail}")
goals = {
    "toy_B8_layer_opt_over_full": [ratio(ms(toy, "tiny", "tgraph_layer_opt"), ms(toy, "tiny", "tgraph_full")), 1.05],
    "toy_B1_layer_opt_over_full": [ratio(ms(toy, "tiny_b1", "tgraph_layer_opt"), ms(toy, "tiny_b1", "tgraph_full")), 1.15],
    "toy_B8_skip_cost_layer_opt": [ratio(ms(toy, "tiny", "tgraph_layer_opt"), ms(toy, "tiny", "tgraph_layer_opt_noskip")), None],
    "toy_B8_skip_cost_full": [ratio(ms(toy, "tiny", "tgraph_full_skip"), ms(toy, "tiny", "tgraph_full")), None],
    "megatron_layer_opt_over_local": [ratio(ms(meg, "tiny", "megatron_opt_tgraph_layer_opt"), ms(meg, "tiny", "megatron_opt_local")), 0.6],
    "megatron_full_over_local": [ratio(ms(meg, "tiny", "megatron_opt_tgraph_full"), ms(meg, "tiny", "megatron_opt_local")), 0.45],
}
try:
    goals["sync_debug_silent"] = [all(r["silent"] for r in json.loads((out / "sync_debug.json").read_text())["results"]), True]
except (OSError, ValueError):
    goals["sync_debug_silent"] = [None, True]
result = {k: {"value": v, "goal": g, "met": None if v is None or g is None else (v == g if isinstance(g, bool) else v <= g)} for k, (v, g) in goals.items()}
print(json.dumps(result, indent=1))
(out / "goals.json").write_text(json.dumps(result, indent=1) + "\n")
EOF
  ls -la "$OUT"
} 2>&1 | tee -a "$LOG"
