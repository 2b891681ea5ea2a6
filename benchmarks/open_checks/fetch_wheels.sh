#!/bin/bash
# The Python packages the GPU box lacks, as wheels in .whl/ (ignored by git; carry [".whl"]
# and install them there as benchmarks/README.md says): the peers (RamTorch; DeepSpeed
# 0.19.8 built as a pure-Python wheel with DS_BUILD_OPS=0, and what it needs that the box
# has not: hjson, pydantic) and diffusers for dit/. Run here, where pip reaches PyPI.
set -eu
cd "$(git rev-parse --show-toplevel)"
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 ramtorch==1.11.0 \
  hjson==3.1.0 pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.2
ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1 || \
  DS_BUILD_OPS=0 $py -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl
