#!/usr/bin/env bash
# Fill wheelhouse/ with attnserve's wheel and the wheels of its serving dependencies (no torch), for
# the Python that runs this script; the image's Python must match it (3.11 on x86_64 by default).
#   deploy/build-wheelhouse.sh [cpu|gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:-cpu}
python=${PYTHON:-python3}
mkdir -p wheelhouse
rm -f wheelhouse/*.whl
"$python" -m pip wheel --quiet --wheel-dir wheelhouse . 2> >(grep -v "^WARNING: Location" >&2)
if [ "$variant" = gpu ]; then
    "$python" -m pip download --quiet --only-binary=:all: --dest wheelhouse onnxruntime-gpu 2> >(grep -v "^WARNING: Location" >&2)
fi
ls wheelhouse/*.whl | wc -l | xargs echo "wheelhouse: wheels:"
