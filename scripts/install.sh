#!/usr/bin/env bash
# Install pyro_scalable and the extras named in $1 -- one ("test", "demo") or several, comma-separated ("test,docs")
# -- into the current Python.
# An existing torch (a CUDA build, say) is kept; only where none is installed do we ask pip for torch 2.13.0,
# a version pip resolves to a CPU wheel on machines that provide one and to PyPI's build elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[${1:-test}]"
