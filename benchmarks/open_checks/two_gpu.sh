#!/bin/bash
# The open checks on a two-GPU machine (nvidia-h100-x2), each as one device call of at most
# ~9 minutes: `bash benchmarks/open_checks/two_gpu.sh PART...` with
#   nccl       issue 29 on NCCL: the multi-rank GPU tests (points 1, 2, 5), then the 2-GPU A/B
#              of the refresh (host copies against broadcast from the owner) at 4x2048 per
#              GPU, lean, with one GPU as the baseline, in the same call (point 3)
#   devopt     issue 29 point 3, the device optimizer under ZeRO: its NCCL tests, then at
#              4x2048 per GPU, lean, one GPU (the planner's device steps) against two GPUs
#              with --device-optimizer on (refresh by broadcast, then from the host) and off
#   pair A B   one_gpu.sh A on GPU 0 and one_gpu.sh B on GPU 1 at the same time, after one
#              set-up (wheels, kernels). For checks of correctness and memory: the two share
#              the host's cores, DRAM and page cache, so their timings are not clean.
# Writes $OUT/nccl.tgz, $OUT/devopt.tgz, or the two parts' own .tgz.
set -u
export PYTHONUNBUFFERED=1
PART=${1:?usage: two_gpu.sh nccl | devopt | pair A B}
here=$(dirname "$0")
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1
fi
export PYTHONPATH=$PWD/src:/tmp/site
( time timeout -k 15 150 python3 -m ramflow.build_kernels ) > /tmp/build.txt 2>&1
# tests_then_rows NAME TESTS_LIMIT_S TESTS ROWS: the multi-rank GPU tests, then the 4x2048-per-
# GPU rows of run_scaling.sh (lean, 18 GiB, ZeRO-2), each "GPUs device-optimizer refresh-flag",
# into $OUT/NAME.tgz, rewritten after each stage
tests_then_rows() {
  local name=$1 limit=$2 tests=$3 rows=$4
  R=/tmp/open-checks-$name; mkdir -p "$R"; cp /tmp/build.txt "$R/"
  pack() { tar -czf "$OUT/$name.tgz" -C "$R" . ; }
  { nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv; nvidia-smi topo -m; nproc; free -g; git log -1 --format=%h 2>/dev/null; } > "$R/device.txt" 2>&1; pack
  timeout -k 15 "$limit" python3 -m pytest -q -m gpu $tests -p no:cacheprovider -rs --durations=20 \
    > "$R/gpu-tests-$name.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$R/gpu-tests-$name.txt"; pack
  export PYTHONPATH=$PWD/src
  local run
  while read -r run; do
    set -- $run
    [ $(( 560 - SECONDS )) -gt 60 ] || { echo "no time for $run" >> "$R/device.txt"; continue; }
    RAMFLOW_REFRESH_BY_BROADCAST=$3 timeout -k 15 $(( 560 - SECONDS )) torchrun --standalone --nproc-per-node "$1" \
      benchmarks/node/multi_gpu.py --warmup 3 --steps 7 --out "$R/scaling.jsonl" --host-precision lean \
      --batch 4 --gpu-memory 18GiB --checkpoint --loss-chunk 4096 --device-optimizer "$2" \
      > "$R/run-$1-$2-refresh$3.log" 2>&1
    echo "run $1 device-optimizer=$2 refresh-by-broadcast=$3: rc=$? at ${SECONDS}s" >> "$R/device.txt"; pack
  done <<< "$rows"
  python3 benchmarks/node/multi_gpu.py --report "$R/scaling.jsonl" > "$R/scaling.md" 2>&1; pack
  tail -3 "$R/gpu-tests-$name.txt"; cat "$R/scaling.md"
}
case "$PART" in
nccl)
  # 1 GPU, then 2 GPUs with each refresh
  tests_then_rows nccl 400 "tests/test_distributed.py tests/train/test_multi_rank.py tests/test_distributed_loading.py" \
    "1 auto 1
2 auto 0
2 auto 1" ;;
devopt)
  # the most telling rows first
  tests_then_rows devopt 200 tests/test_distributed_device_optimizer.py "1 auto 1
2 on 1
2 off 1
2 on 0" ;;
pair)
  bash "$here/parts.sh" "${2:?pair needs two parts}" "${3:?pair needs two parts}" ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
