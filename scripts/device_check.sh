#!/usr/bin/env bash
# The device check (docs/BENCHMARKS.md, "GPU and many-core"): what a lent GPU machine (one H100, 16 CPU cores, no
# registry) measures in under 8 minutes, into one JSON and one markdown table.
#
#   scripts/device_check.sh [OUT_DIR [ARGS]]   on the lent machine: install, then measure (OUT_DIR: $OUT, else
#                                              ./device-check; ARGS go to the module, e.g. --sections costs)
#   scripts/device_check.sh --dry-run [DIR]    every step on this CPU with tiny shapes (under 2 minutes; CI runs it
#                                              through tests/test_device_check.py)
#   scripts/device_check.sh --prepare          here, before the run: the wheels the machine lacks, and a portable
#                                              llama-cpp-python built from source, into .device_wheels/ (git-ignored;
#                                              the device tool's run takes it with carry=[".device_wheels"])
#
# On the machine the project installs with pip --no-deps onto its own PyTorch and transformers, beside the carried
# wheels, into a folder of its own: nothing there is fetched, nothing of its image is replaced.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python3}
export SPECDECODE_REPO=$repo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

case "${1:-}" in
  --prepare)
    shift
    exec "$py" -m specdecode.bench.device_check --prepare "$@" ;;
  --dry-run)
    out=${2:-${OUT:-/tmp/device-check-dry-run}}
    exec "$py" -m specdecode.bench.device_check --dry-run --out "$out" ;;
  -h|--help)
    sed -n 2,16p "$0"; exit 0 ;;
  -*)
    echo "unknown option $1: use --dry-run, --prepare, or an output folder" >&2; exit 2 ;;
esac

out=${1:-${OUT:-$repo/device-check}}
site=/tmp/specdecode-device-site
rm -rf "$site" && mkdir -p "$site" "$out"
if ls .device_wheels/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .device_wheels/*.whl \
    || echo "[device check] installing the carried wheels failed (see above)" >&2
else
  echo "[device check] no .device_wheels/ here: run scripts/device_check.sh --prepare first, and carry it" >&2
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$site" . \
  || echo "[device check] pip install of the project failed: running it from src/" >&2
export PYTHONPATH=$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}
"$py" -m specdecode.bench.device_check --out "$out" "${@:2}" 2>&1 | tee "$out/device_check.log"
