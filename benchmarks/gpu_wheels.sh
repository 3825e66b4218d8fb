#!/usr/bin/env bash
# Run on a machine WITH registry access before a GPU session: DeepSpeed and the dependencies its GPU image
# lacks (hjson, pydantic and its three helpers), as wheels for that image's Python 3.12, into .whl (git-ignored
# through .git/info/exclude). benchmarks/gpu_session.sh installs them there; name .whl in the device call's carry.
# Versions: those this project was tested with on CPU (PLATFORM_NOTES.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHL_DIR:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
if [ "$DEST" = .whl ]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$DEST" \
    hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
# DeepSpeed is published as an sdist only; its wheel is pure Python (no ops are built at install time).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$DEST" 2>/dev/null \
    || DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps deepspeed==0.19.8 -w "$DEST"
ls -la "$DEST"
