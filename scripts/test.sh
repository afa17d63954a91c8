#!/usr/bin/env bash
# Install the test and docs dependencies (and the comparison peers) and run the test suite (the fast tier; add `-m ""`
# for the slow tests too). The suite includes `mkdocs build --strict` of the documentation site (tests/test_docs.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,docs
# laplace-torch and posteriors for the comparison tests (torch left alone; skipped if they cannot be installed)
bash scripts/install_peers.sh
exec "${PYTHON:-python3}" -m pytest "$@"
