#!/bin/bash
# Several one_gpu.sh parts at once, part i on GPU i, after one set-up (wheels, kernels):
#   bash benchmarks/open_checks/parts.sh A B [C D ...]
# Each part gets an equal share of the host's cores (taskset) and, on an H200 machine whose
# MemAvailable starts small, an equal share of RAMFLOW_HOST_RAM (give the whole host's).
# For checks of correctness, memory and accuracy: the parts share the host's DRAM and page
# cache, so their timings are not clean (a 4-GPU host gives each part 16 cores, as the
# one-GPU box has). Each part writes its own $OUT/PART.tgz. A part "A+B" runs A, then B on
# the same GPU within the one LIMIT (B is skipped when less than 60 s are left).
set -u
[ $# -ge 1 ] || { echo "usage: parts.sh PART..." >&2; exit 2; }
here=$(dirname "$0")
gpus=$(nvidia-smi --list-gpus | wc -l)
[ $# -le "$gpus" ] || { echo "$# parts for $gpus GPUs" >&2; exit 2; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1
fi
PYTHONPATH=$PWD/src:/tmp/site timeout -k 15 150 python3 -m ramflow.build_kernels > /tmp/build.txt 2>&1
cores=$(nproc); share=$(( cores / $# ))
host_gib=${RAMFLOW_HOST_RAM:-}; host_gib=${host_gib%GiB}
i=0
for part in "$@"; do
  first=$(( i * share )); last=$(( first + share - 1 ))
  ram=()
  [ -n "${RAMFLOW_HOST_RAM:-}" ] && ram=(RAMFLOW_HOST_RAM="$(( host_gib / $# ))GiB")
  env "${ram[@]}" SETUP_DONE=1 CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=$share \
    taskset -c "$first-$last" bash -c 'lim=${LIMIT:-560}; for p in ${1//+/ }; do
      left=$(( lim - SECONDS )); [ "$left" -gt 60 ] || { echo "no time for $p"; continue; }
      LIMIT=$left bash "$0" "$p"; done' "$here/one_gpu.sh" "$part" > "/tmp/part-$i.txt" 2>&1 &
  i=$(( i + 1 ))
done
wait
for j in $(seq 0 $(( i - 1 ))); do echo "== part $j"; tail -12 "/tmp/part-$j.txt"; done
