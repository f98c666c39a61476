#!/bin/bash
# `make gpu-check` on a GPU machine with no network whose Python already holds torch, transformers and accelerate
# (the lent machine's image: torch 2.11+cu130, transformers 5.17, accelerate 1.15), as docs/gpu.md's results ran:
#   here:  bash bench/gpu_check_offline.sh fetch      wheels of uv.lock's versions of what that image lacks -> .whl/
#   there: bash bench/gpu_check_offline.sh run [PART...]   installs them to /tmp/site, runs bench/gpu_check.py
# deepspeed is an sdist: its wheel is built here (pure Python, no ops). .whl/ must be ignored (.git/info/exclude).
set -u
cd "$(dirname "$0")/.." || exit 2
MISSING="trl peft datasets deepspeed bitsandbytes liger-kernel math-verify latex2sympy2-extended antlr4-python3-runtime
pydantic pydantic-core annotated-types typing-inspection hjson dill multiprocess fsspec jsonschema referencing rpds-py
jsonschema-specifications py-spy kernels kernels-data"
case "${1:-}" in
fetch)
    mkdir -p .whl
    for p in $MISSING; do
        v=$(grep -A1 "^name = \"$p\"$" uv.lock | sed -n 's/^version = "\(.*\)"$/\1/p' | head -1)
        [ -n "$v" ] || { echo "gpu_check_offline: $p is not in uv.lock" >&2; exit 2; }
        if [ "$p" = deepspeed ]; then
            DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$v" -w .whl || exit 1
        else
            .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
                --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl "$p==$v" || exit 1
        fi
    done
    du -sh .whl ;;
run)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 SKYPILOT_DISABLE_LOCAL_API_SERVER=1
    python3 bench/gpu_check.py "$@" ;;
*)
    echo "usage: bash bench/gpu_check_offline.sh fetch | run [PART...]" >&2; exit 2 ;;
esac
