#!/usr/bin/env bash
# One host, 1, 2 and 4 GPUs: tokens/s of the reference model at 4x2048 and 16x2048 tokens per
# GPU, under 24 GiB per GPU (the model's own checkpointing, the head and loss in chunks), for
# each host format named, ZeRO-2. META=1 builds on the meta device (weights=). With FLOORS=1 it first measures what the ranks share
# (`multi_gpu.py --floors`). Appends to $1/scaling.jsonl, a log per run beside it.
# DEVOPT="auto on" runs each row with each --device-optimizer (one GPU: the planner's auto
# only; on several, under ZeRO: auto is each rank's planner's choice among the resident units
# it owns, "on" steps all of them on its GPU). STEPSTREAM="0 1" runs the multi-GPU device-
# optimizer rows with and without a stream of their own for the device steps
# (RAMFLOW_DEVICE_STEP_STREAM, on by default; [Note: the device optimizer under ZeRO] in
# src/ramflow/engine/device_stepper.py).
# The second table of the report says where each rank's step waits ([Note: the step's sync]).
# GPUS="1 4" runs those GPU counts only (default 1 2 4).
# Usage: FLOORS=1 REFRESH="host broadcast" DEVOPT="auto on" bash benchmarks/node/run_scaling.sh "$OUT" fp32 lean
set -u
out=${1:?usage: run_scaling.sh OUT FORMAT...}
shift
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
run() {  # gpus, extra args
  local n=$1; shift
  local log="$out/run-$n-refresh${REFRESH_FLAG:-1}-stream${STREAM_FLAG:-1}-$(echo "$*" | tr -d '-' | tr ' ' '_').log"
  RAMFLOW_DEVICE_STEP_STREAM=${STREAM_FLAG:-1} RAMFLOW_REFRESH_BY_BROADCAST=${REFRESH_FLAG:-1} timeout 240 torchrun --standalone --nproc-per-node "$n" benchmarks/node/multi_gpu.py ${META:+--meta} \
    --warmup 3 --steps 7 --out "$out/scaling.jsonl" "$@" > "$log" 2>&1 || echo "run $n $* failed: $? (see $log)"
}
if [ "${FLOORS:-0}" = 1 ]; then
  run "$gpus" --floors
fi
# ramflow's own budget; the model's checkpointed activations take the rest of 24 GiB
# (about 3 GiB at 4x2048, 9 GiB at 16x2048; each row reports the peak it reached)
# REFRESH="host broadcast" runs the multi-GPU rows both ways (RAMFLOW_REFRESH_BY_BROADCAST,
# see [Note: refresh by broadcast] in src/ramflow/distributed/zero.py); one GPU has nothing to refresh
for fmt in "$@"; do
  for n in ${GPUS:-1 2 4}; do
    [ "$n" -le "$gpus" ] || continue
    for refresh in ${REFRESH:-broadcast}; do
      [ "$n" -gt 1 ] || [ "$refresh" = broadcast ] || continue
      REFRESH_FLAG=0; [ "$refresh" = broadcast ] && REFRESH_FLAG=1
      for devopt in ${DEVOPT:-auto}; do
        [ "$n" -gt 1 ] || [ "$devopt" = auto ] || continue
        streams=${STEPSTREAM:-1}; [ "$n" -gt 1 ] || streams=1  # one GPU: nothing to reduce
        for STREAM_FLAG in $streams; do
          # no device step: the stream does not matter, one row
          [ "$devopt" != off ] || [ "$STREAM_FLAG" = "${streams%% *}" ] || continue
          run "$n" --host-precision "$fmt" --batch 4 --gpu-memory 18GiB --checkpoint --loss-chunk 4096 --device-optimizer "$devopt"
          run "$n" --host-precision "$fmt" --batch 16 --gpu-memory 12GiB --checkpoint --loss-chunk 4096 --device-optimizer "$devopt"
        done
      done
    done
  done
done
python3 benchmarks/node/multi_gpu.py --report "$out/scaling.jsonl" | tee "$out/scaling.md"
