#!/usr/bin/env bash
# Issue 5 on a two-GPU box: the GPU tests (NCCL), then one GPU against two on the reference
# model at the same per-GPU batch. Writes everything under $1 (default ./multi-gpu-out).
# Usage: bash benchmarks/node/run_multi_gpu.sh "$OUT"
set -u
out=${1:-multi-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
{
  echo "# ramflow GPU tests, $(date -u)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  df -h /dev/shm | tail -1
  timeout 260 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1
} > "$out/gpu-tests.txt" 2>&1
grep -E "passed|failed" "$out/gpu-tests.txt" | tail -3
run() {  # gpus, extra args
  local n=$1; shift
  timeout 170 torchrun --nproc-per-node "$n" benchmarks/node/multi_gpu.py --out "$out/multi_gpu.jsonl" "$@" \
    > "$out/multi_gpu-$n-$(echo "$*" | tr ' ' '_').log" 2>&1 || echo "run $n $* failed: $?"
}
run 1 --batch 4
run 2 --batch 4 --zero-stage 2
run 2 --batch 4 --zero-stage 1
run 1 --batch 16
run 2 --batch 16 --zero-stage 2
python3 benchmarks/node/multi_gpu.py --report "$out/multi_gpu.jsonl" | tee "$out/multi_gpu.md"
