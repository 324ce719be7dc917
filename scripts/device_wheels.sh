#!/usr/bin/env bash
# Fetch, here, the wheels scripts/device_check.sh installs on the GPU machine (Python 3.12,
# x86-64; its image has torch, numpy, grpcio, httpx, hypothesis, pytest-xdist but
# not these, or other versions). .whl/ is git-ignored; the device tool carries it when a run names it in `carry`.
set -eu
cd "$(dirname "$0")/.."
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    flwr==1.41.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types typing-inspection protobuf==6.33.6 \
    cryptography==50.0.2 cffi==2.0.0 pycparser==3.0 pycryptodome==3.24.1 iterators==0.0.2 tomli==2.5.0 tomli_w==1.2.0 \
    grpcio-health-checking==1.81.1 isal==1.9.1 typing_extensions==4.16.0 typer==0.20.1 click==8.5.1 shellingham==1.5.4 rich==14.3.4
ls .whl
