#!/usr/bin/env bash
# Install the test dependencies and run the test suite (the fast tier; add `-m ""` for the slow tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec "${PYTHON:-python3}" -m pytest "$@"
