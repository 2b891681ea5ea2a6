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
case "$PART" in
nccl)
  R=/tmp/open-checks-nccl; mkdir -p "$R"; cp /tmp/build.txt "$R/"
  pack() { tar -czf "$OUT/nccl.tgz" -C "$R" . ; }
  { nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv; nvidia-smi topo -m; nproc; free -g; git log -1 --format=%h 2>/dev/null; } > "$R/device.txt" 2>&1; pack
  timeout -k 15 400 python3 -m pytest -q -m gpu tests/test_distributed.py tests/train/test_multi_rank.py \
    tests/test_distributed_loading.py -p no:cacheprovider -rs --durations=20 > "$R/gpu-tests-dist.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$R/gpu-tests-dist.txt"; pack
  # run_scaling.sh's 4x2048 row, lean, 1 GPU then 2 GPUs with each refresh
  export PYTHONPATH=$PWD/src
  for run in "1 0" "2 0" "2 1"; do
    set -- $run
    [ $(( 560 - SECONDS )) -gt 60 ] || { echo "no time for $run" >> "$R/device.txt"; continue; }
    RAMFLOW_REFRESH_BY_BROADCAST=$2 timeout -k 15 $(( 560 - SECONDS )) torchrun --standalone --nproc-per-node "$1" \
      benchmarks/node/multi_gpu.py --warmup 3 --steps 7 --out "$R/scaling.jsonl" --host-precision lean \
      --batch 4 --gpu-memory 18GiB --checkpoint --loss-chunk 4096 > "$R/run-$1-refresh$2.log" 2>&1
    echo "run $1 refresh-by-broadcast=$2: rc=$? at ${SECONDS}s" >> "$R/device.txt"; pack
  done
  python3 benchmarks/node/multi_gpu.py --report "$R/scaling.jsonl" > "$R/scaling.md" 2>&1; pack
  tail -3 "$R/gpu-tests-dist.txt"; cat "$R/scaling.md" ;;
devopt)
  R=/tmp/open-checks-devopt; mkdir -p "$R"; cp /tmp/build.txt "$R/"
  pack() { tar -czf "$OUT/devopt.tgz" -C "$R" . ; }
  { nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv; nproc; free -g; git log -1 --format=%h 2>/dev/null; } > "$R/device.txt" 2>&1; pack
  timeout -k 15 200 python3 -m pytest -q -m gpu tests/test_distributed_device_optimizer.py \
    -p no:cacheprovider -rs --durations=20 > "$R/gpu-tests-devopt.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$R/gpu-tests-devopt.txt"; pack
  export PYTHONPATH=$PWD/src
  # GPUs, --device-optimizer, RAMFLOW_REFRESH_BY_BROADCAST; the most telling rows first
  for run in "1 auto 0" "2 on 1" "2 off 1" "2 on 0"; do
    set -- $run
    [ $(( 540 - SECONDS )) -gt 60 ] || { echo "no time for $run" >> "$R/device.txt"; continue; }
    RAMFLOW_REFRESH_BY_BROADCAST=$3 timeout -k 15 $(( 540 - SECONDS )) torchrun --standalone --nproc-per-node "$1" \
      benchmarks/node/multi_gpu.py --warmup 3 --steps 7 --out "$R/scaling.jsonl" --host-precision lean \
      --batch 4 --gpu-memory 18GiB --checkpoint --loss-chunk 4096 --device-optimizer "$2" \
      > "$R/run-$1-$2-refresh$3.log" 2>&1
    echo "run $1 device-optimizer=$2 refresh-by-broadcast=$3: rc=$? at ${SECONDS}s" >> "$R/device.txt"; pack
  done
  python3 benchmarks/node/multi_gpu.py --report "$R/scaling.jsonl" > "$R/scaling.md" 2>&1; pack
  tail -3 "$R/gpu-tests-devopt.txt"; cat "$R/scaling.md" ;;
pair)
  A=${2:?pair needs two parts}; B=${3:?pair needs two parts}
  export SETUP_DONE=1
  CUDA_VISIBLE_DEVICES=0 bash "$here/one_gpu.sh" "$A" > /tmp/pair-a.txt 2>&1 &
  CUDA_VISIBLE_DEVICES=1 bash "$here/one_gpu.sh" "$B" > /tmp/pair-b.txt 2>&1 &
  wait
  tail -15 /tmp/pair-a.txt /tmp/pair-b.txt ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
