#!/bin/bash
# The GPU checks of the second 2026-12-07 session (issues 47, 48), on one GPU, as device calls:
#   bash benchmarks/open_checks/session2_check.sh predict   the reference cases with the floors
#       (the planner's prediction beside each measured step), fp32 twice (run-to-run loss), and
#       the loading rate of a 14B shape (issue 48 point 5)
#   bash benchmarks/open_checks/session2_check.sh tests [PATHS]  the GPU suite (pytest -m gpu)
#   bash benchmarks/open_checks/session2_check.sh moe    routed experts' decode benchmark
#   bash benchmarks/open_checks/session2_check.sh final  the GPU suite, then the routed experts' benchmark
#   bash benchmarks/open_checks/session2_check.sh moebench [ARGS]  MoE training throughput beside
#       DeepSpeed and accelerate (issue 47 points 2 and 5; benchmarks/moe/throughput.py, its
#       --budget-s from MOE_BUDGET_S, default 280; ARGS go to it, e.g. --only dsv2)
# Carry [".whl"]. Each part writes under $OUT.
set -u
PART=${1:?usage: session2_check.sh predict|tests|moe|final|moebench}
export PYTHONUNBUFFERED=1
# every part needs the carried wheels: the GPU suite imports diffusers at collection (a
# session-3 call without them stopped there), the peers need DeepSpeed and RamTorch
ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/ here: call run with carry [\".whl\"] (fetch_wheels.sh makes it)" | tee "$OUT/NO-WHEELS.txt"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
commit=$(git log -1 --format=%h 2>/dev/null || echo unknown)
{ echo "commit $commit"; nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/device-$PART.txt" 2>&1
( time timeout 150 python3 -m ramflow.build_kernels ) >> "$OUT/device-$PART.txt" 2>&1
case "$PART" in
predict)
  RAMFLOW_BENCH_COMMIT=$commit timeout 260 python3 benchmarks/bench.py --floors --ramflow \
    --only floors --only train --host-precision lean --budget-s 230 --out-dir /tmp/bench-lean > "$OUT/bench.log" 2>&1
  cp /tmp/bench-lean/*/*.json "$OUT/" 2>/dev/null
  for i in 1 2; do
    RAMFLOW_BENCH_COMMIT=$commit timeout 80 python3 benchmarks/bench.py --ramflow \
      --only train.4x2048 --host-precision fp32 --budget-s 70 --out-dir /tmp/bench-fp32-$i >> "$OUT/bench.log" 2>&1
    cp /tmp/bench-fp32-$i/*/*.json "$OUT/bench-fp32-run$i.json" 2>/dev/null
  done
  for hp in fp32 lean; do
    timeout 150 python3 benchmarks/load/load_rate.py --params 1.4e10 --sources seeded,normal \
      --host-precision $hp --threads 16 --out "$OUT/load-rate-14b-$hp.json" >> "$OUT/load-rate.txt" 2>&1
    echo "rc=$? at ${SECONDS}s" >> "$OUT/load-rate.txt"
  done ;;
moe)
  timeout 400 python3 benchmarks/moe/routed_experts.py --layers 8 --new-tokens 32 --out-dir "$OUT" > "$OUT/routed.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/routed.txt" ;;
final)
  timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs --durations=15 > "$OUT/gpu-tests.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/gpu-tests.txt"
  timeout $((560 - SECONDS)) python3 benchmarks/moe/routed_experts.py --layers 8 --new-tokens 32 --out-dir "$OUT" > "$OUT/routed.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/routed.txt" ;;
moebench)
  shift
  RAMFLOW_BENCH_COMMIT=$commit timeout $((590 - SECONDS)) python3 benchmarks/moe/throughput.py \
    --budget-s "${MOE_BUDGET_S:-280}" --out-dir "$OUT/moe-throughput" "$@" > "$OUT/moe-throughput.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/moe-throughput.txt" ;;
tests)
  shift
  timeout 500 python3 -m pytest -q -m gpu ${@:-tests} -p no:cacheprovider -rs --durations=15 > "$OUT/gpu-tests.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/gpu-tests.txt" ;;
esac
