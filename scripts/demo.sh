#!/usr/bin/env bash
# Install the demo dependencies and run the demo: SGHMC on the Wisconsin breast-cancer data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
exec "${PYTHON:-python3}" -m pyro_scalable.demo "$@"
