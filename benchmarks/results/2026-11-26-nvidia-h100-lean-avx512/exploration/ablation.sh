export PYTHONPATH=$PWD/src
for ab in 0 1 2 4 7; do echo "ablate=$ab"; RAMFLOW_ABLATE=$ab python lean_isa_sweep.py avx512 lean 1,16 2>&1 | grep -v quantize; done
