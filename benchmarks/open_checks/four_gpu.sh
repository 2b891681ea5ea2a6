#!/bin/bash
# Issue 29's checks on a four-GPU machine (nvidia-h100-x4 or the nvidia-h200-x4 it may
# become), each one device call of at most ~9 minutes: `bash benchmarks/open_checks/four_gpu.sh PART`
#   nccl     the multi-rank GPU tests of the step's sync and the device optimizer under ZeRO
#            (device steps on their own stream, the default, then RAMFLOW_DEVICE_STEP_STREAM=0),
#            the example's NCCL test
#   final29  the step stream's test of state_dict right after a step on NCCL, then 1, 2 and
#            4 GPUs, lean and fp32, 4x2048 and 16x2048 per GPU, the planner's device optimizer,
#            device steps on their own stream: point 3's table in one run
#   scaling  1 and 4 GPUs, lean, 4x2048 and 16x2048 per GPU, device optimizer auto and on,
#            the device steps' stream off and on (point 3), with the per-rank wait table
#   node70 [ARGS]  the 70B full fine-tune through the Python API and `ramflow train` (point 4);
#            ARGS go to node_70b.py (--cli-first: the CLI first, on the fresh machine)
#   deepspeed70  DeepSpeed ZeRO-3 offload on the same 70B shape, 4 ranks (point 4): trained, or
#            stopped by its watchdog with the host memory it reached (carry [".whl"] from
#            fetch_wheels.sh)
#   parts A B C D   one one_gpu.sh part per GPU (parts.sh), e.g. accuracy-0 accuracy-1 ...
# Writes $OUT/PART.tgz, rewritten after each stage. On an H200 machine (RAM starts small)
# give RAMFLOW_HOST_RAM=480GiB.
set -u
export PYTHONUNBUFFERED=1
PART=${1:?usage: four_gpu.sh nccl | final29 | scaling | node70 | deepspeed70 | parts A B C D}
here=$(dirname "$0")
R=/tmp/four-gpu-$PART; mkdir -p "$R"
pack() { tar -czf "$OUT/$PART.tgz" -C "$R" . ; }
export PYTHONPATH=$PWD/src
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; nproc; free -g; df -h /dev/shm; git log -1 --format=%h 2>/dev/null; } > "$R/device.txt" 2>&1
[ "$PART" = parts ] || { ( time timeout -k 15 150 python3 -m ramflow.build_kernels ) > "$R/build.txt" 2>&1; pack; }
left() { echo $(( ${LIMIT:-560} - SECONDS )); }
case "$PART" in
nccl)
  tests="tests/test_distributed_device_optimizer.py tests/test_llama_torchrun.py"
  timeout -k 15 300 python3 -m pytest -q -m gpu $tests -p no:cacheprovider -rs --durations=10 \
    > "$R/gpu-tests.txt" 2>&1; echo "rc=$? at ${SECONDS}s" >> "$R/gpu-tests.txt"; pack
  RAMFLOW_DEVICE_STEP_STREAM=0 timeout -k 15 "$(left)" python3 -m pytest -q -m gpu \
    tests/test_distributed_device_optimizer.py -p no:cacheprovider -rs > "$R/gpu-tests-compute-stream.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$R/gpu-tests-compute-stream.txt" ;;
final29)
  timeout -k 15 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    "tests/test_distributed_device_optimizer.py::test_state_dict_and_undo_right_after_a_step_see_its_weights" \
    > "$R/gpu-tests-step-stream.txt" 2>&1; rc=$?; echo "rc=$rc at ${SECONDS}s" >> "$R/gpu-tests-step-stream.txt"; pack
  # a failure ends the call here: the table would measure a path that is not right
  [ "$rc" = 0 ] || { tail -n 40 "$R/gpu-tests-step-stream.txt"; exit 1; }
  GPUS="1 2 4" DEVOPT=auto META=1 timeout -k 15 "$(left)" \
    bash benchmarks/node/run_scaling.sh "$R" lean fp32 > "$R/run_scaling.txt" 2>&1
  python3 benchmarks/node/multi_gpu.py --report "$R/scaling.jsonl" > "$R/scaling.md" 2>&1 ;;
scaling)
  GPUS="1 4" DEVOPT="auto on" STEPSTREAM="0 1" META=1 timeout -k 15 "$(left)" \
    bash benchmarks/node/run_scaling.sh "$R" lean > "$R/run_scaling.txt" 2>&1
  python3 benchmarks/node/multi_gpu.py --report "$R/scaling.jsonl" > "$R/scaling.md" 2>&1 ;;
node70)
  shift  # the rest goes to node_70b.py, e.g. --cli-first
  timeout -k 15 "$(left)" python3 benchmarks/node/node_70b.py --both --steps 4 --clip-grad 0 \
    --out-dir "$R/n70" --budget-s $(( $(left) - 20 )) "$@" > "$R/node_70b.txt" 2>&1
  rm -rf "$R/n70/run/checkpoints" ;;
deepspeed70)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$R/pip.txt" 2>&1
  PYTHONPATH=$PWD/src:/tmp/site DS_BUILD_OPS=0 timeout -k 15 "$(left)" torchrun --standalone --nproc-per-node 4 \
    benchmarks/peers/deepspeed_zero3_big.py --shape llama-70b --batch 4 --seq 4096 --reserve 16GiB \
    --out-dir "$R/ds" > "$R/deepspeed.log" 2>&1; echo "rc=$? at ${SECONDS}s" >> "$R/deepspeed.log" ;;
parts)
  shift; bash "$here/parts.sh" "$@"; exit ;;
*) echo "unknown part $PART" >&2; exit 2 ;;
esac
echo "done at ${SECONDS}s" >> "$R/device.txt"; pack
tail -n 3 "$R"/*.txt; cat "$R"/scaling.md "$R"/n70/node_70b.md 2>/dev/null | tail -30
