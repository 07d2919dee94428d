OUT=${OUT:-./o}; mkdir -p /tmp/w
timeout 120 bash .te/pkg/install_on_device.sh prune > /tmp/w/te.log 2>&1; echo te=$?
. /tmp/site/te_env.sh
timeout 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/w/mg.log 2>&1; echo mg=$?
export PYTHONPATH="$PWD:$PYTHONPATH"
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short tests/test_megatron_optimizer_graph.py tests/test_memory.py > "$OUT/pytest_megatron_memory.log" 2>&1; echo pytest=$?
timeout 100 python -m pytest -q -m "not cuda" -p no:cacheprovider --tb=short tests/test_megatron_optimizer_graph.py > "$OUT/pytest_megatron_cpu_torch211.log" 2>&1; echo cpu=$?
timeout 70 python scripts/profile_host.py --device cuda --backend cuda --model llama --steps 200 --reps 3 --out "$OUT" > "$OUT/profile_host.log" 2>&1; echo prof=$?
tail -5 "$OUT/pytest_megatron_memory.log"; tail -3 "$OUT/pytest_megatron_cpu_torch211.log"; grep -E "per graphed call|checks_baked|autograd_function|backward:|input_copies|step wall|stubbed out:|fail-closed" "$OUT/profile_host.log"
