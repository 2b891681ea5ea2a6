#!/bin/bash
# The GPU checks of the 2026-12-07 session (issues 46, 47, 48) on one GPU, as device calls:
#   bash benchmarks/open_checks/house_check.sh tests   the GPU suite (pytest -m gpu)
#   bash benchmarks/open_checks/house_check.sh bench   the reference training cases before the
#       house's moves (.baseline/: commit 72bd354, carried) and now, on one machine
#   bash benchmarks/open_checks/house_check.sh moe     `ramflow plan` against `ramflow train` of
#       the DeepSeek-V2-Lite shape (15.7 B, 64 experts + 2 shared), lean, under 24 GiB
# Carry [".whl", ".baseline"]. Each part writes under $OUT (at most 8 files come back).
set -u
PART=${1:?usage: house_check.sh tests|bench|moe}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/device-$PART.txt" 2>&1
( time timeout 150 python3 -m ramflow.build_kernels ) >> "$OUT/device-$PART.txt" 2>&1
case "$PART" in
tests)
  timeout 500 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs --durations=15 > "$OUT/gpu-tests.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/gpu-tests.txt" ;;
bench)
  # the real out-of-memory test failed in this session's GPU suite on an H100: the same
  # test at 72bd354 on the same machine says whether it ever passed here
  for tree in .baseline .; do
    ( cd "$tree" && PYTHONPATH=$PWD/src:/tmp/site timeout 90 python3 -m pytest -q -m gpu \
        tests/train/test_oom_backoff.py -k real_out_of_memory -p no:cacheprovider 2>&1 | tail -4 ) \
      >> "$OUT/oom-test.txt" 2>&1
  done
  for hp in lean fp32; do
    for tree in .baseline .; do
      name=$([ "$tree" = . ] && echo now || echo before)
      commit=$([ "$tree" = . ] && git log -1 --format=%h 2>/dev/null || echo 72bd354)
      ( cd "$tree" && RAMFLOW_BENCH_COMMIT=$commit PYTHONPATH=$PWD/src:/tmp/site timeout 170 \
          python3 benchmarks/bench.py --ramflow --only train.4x2048.cap12gib --host-precision $hp \
          --budget-s 150 --out-dir "/tmp/bench-$name-$hp" ) >> "$OUT/bench.log" 2>&1
      cp /tmp/bench-$name-$hp/*/*.json "$OUT/bench-$name-$hp.json" 2>/dev/null
    done
  done ;;
moe)
  args="--preset deepseek-v2-lite --host-precision lean --batch-size 8 --seq-len 4096 --gpu-memory 24GiB"
  timeout 120 python3 -m ramflow plan $args > "$OUT/moe-plan.txt" 2>&1
  timeout 420 python3 -m ramflow train $args --steps 6 --keep-checkpoints 0 --out /tmp/moe-run \
    --no-progress > "$OUT/moe-train.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$OUT/moe-train.txt"
  cp /tmp/moe-run/log.jsonl "$OUT/moe-log.jsonl" 2>/dev/null ;;
esac
