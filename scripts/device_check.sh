#!/usr/bin/env bash
# The device check (docs/BENCHMARKS.md, "GPU and many-core"): what a lent GPU machine (one H100 or H200, 16 CPU
# cores, no registry) measures in a few minutes, into one JSON and one markdown table, with every section's rows
# (rows.jsonl) and a timestamped line per step (progress.log) written as it goes: a killed section still reports.
#
#   scripts/device_check.sh [OUT_DIR [ARGS]]   on the lent machine: install, then measure (OUT_DIR: $OUT, else
#                                              ./device-check; ARGS go to benchmarks/device_check.py, e.g.
#                                              --sections environment,compiled --budget 280)
#   scripts/device_check.sh --dry-run [DIR]    every step on this CPU with tiny shapes (3-5 minutes on 2 busy
#                                              cores; CI runs it through tests/test_device_check.py)
#   scripts/device_check.sh --prepare          here, before the run: the wheels the machine lacks, a portable
#                                              llama-cpp-python built from source, and the cross_vocab section's
#                                              tokenizers (Qwen2.5-Coder-1.5B's, SmolLM2-135M's: from the installed
#                                              GGUF packages, gzip-compressed, ~2.7 MB; no weights) into
#                                              .device_wheels/ (git-ignored; the device tool's run takes it with
#                                              carry=[".device_wheels"])
#
# On the machine the project installs with pip --no-deps onto its own PyTorch and transformers, beside the carried
# wheels, into a folder of its own: nothing there is fetched, nothing of its image is replaced. The check itself
# (benchmarks/) is not part of the package: it runs from this checkout (python -m benchmarks.device_check).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${PYTHON:-python3}
export SPECDECODE_REPO=$repo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# torch.compile's code generation in one worker per core (Inductor's own default, said out loud and recorded by the
# environment section), its cache where a second call on the same warm machine finds it
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(nproc)}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/specdecode-inductor-cache}

case "${1:-}" in
  --prepare)
    shift
    exec "$py" -m benchmarks.device_check --prepare "$@" ;;
  --dry-run)
    out=${2:-${OUT:-/tmp/device-check-dry-run}}
    exec "$py" -m benchmarks.device_check --dry-run --out "$out" ;;
  -h|--help)
    sed -n 2,20p "$0"; exit 0 ;;
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
"$py" -m benchmarks.device_check --out "$out" "${@:2}" 2>&1 | tee "$out/device_check.log"
