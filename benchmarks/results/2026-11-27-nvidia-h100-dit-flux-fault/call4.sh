#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
R=/tmp/r; mkdir -p $R
run() { timeout 60 python3 benchmarks/dit/flux_nan_check.py "$@" 2>&1 | grep -v Warning | tail -4 >> $R/diag.txt; }
run --mode resident
run --mode resident --accel 0
run
run --ckpt 0
run --accel 0
run --accel 0 --ckpt 0
run --wire fp32
run --autocast 0
run --accel 0 --autocast 0 --wire bf16
DIAG=blocking CUDA_LAUNCH_BLOCKING=1 run --accel 0
DIAG=nocache PYTORCH_NO_CUDA_MEMORY_CACHING=1 run --accel 0
run --accel 0 --gpu-memory 1GiB
cp $R/diag.txt $OUT/; cat $R/diag.txt
