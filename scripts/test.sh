#!/usr/bin/env bash
# Install the test dependencies (and the comparison peers) and run the test suite (the fast tier; add `-m ""` for the slow tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# laplace-torch and posteriors for the comparison tests (torch left alone; skipped if they cannot be installed)
bash scripts/install_peers.sh
exec "${PYTHON:-python3}" -m pytest "$@"
