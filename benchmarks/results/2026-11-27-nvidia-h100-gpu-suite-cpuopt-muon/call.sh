#!/bin/bash
# session 17, device call 1: kernels, the whole GPU suite, CPU optimizer rates, Muon
export PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R
pack() { tar -czf $OUT/r.tgz -C $R . ; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/device.txt; nproc >> $R/device.txt; free -g >> $R/device.txt
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> $R/device.txt 2>&1
( time timeout 150 python3 -m ramflow.build_kernels ) > $R/build.txt 2>&1; pack
timeout 290 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs --durations=15 > $R/gpu-tests.txt 2>&1; echo "rc=$? at ${SECONDS}s" >> $R/gpu-tests.txt; pack
timeout 100 python3 benchmarks/cpu_optimizer_runner.py --out-dir $R/cpuopt > $R/cpuopt.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $R/cpuopt.log; pack
left=$(( 565 - SECONDS ))
timeout $left python3 benchmarks/muon/muon_bench.py --out-dir $R/muon --repeat 3 > $R/muon-stdout.log 2>&1; echo "rc=$? at ${SECONDS}s" >> $R/muon-stdout.log; pack
tail -3 $R/gpu-tests.txt; tail -3 $R/cpuopt.log; tail -3 $R/muon-stdout.log
