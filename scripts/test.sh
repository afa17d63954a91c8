#!/usr/bin/env bash
# Install the test, docs and demo dependencies (and the comparison peers) and run the test suite: the fast tier
# (add `-m ""` for the slow tests too), which includes `mkdocs build --strict` of the documentation site
# (tests/test_docs.py), the demo (tests/test_demo.py) and every tutorial in its fast mode (tests/test_tutorials.py).
#
# Then the ArviZ-facing tests (marked `arviz`: the converter, the demo, the tutorials, the docs' first model) run a
# second time against the other ArviZ major -- 1.x where pip gave this Python 0.x (Python < 3.12), 0.x where it gave
# 1.x -- installed by scripts/other_arviz.py into .arviz-other/ and put first on PYTHONPATH. That second pass is
# skipped when you name test files or folders (`bash scripts/test.sh tests/test_demo.py`), or with ONE_ARVIZ=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# nn: peft and transformers, for tests/nn/test_peft.py and the LoRA tutorial (tutorials/lora_transformer.py)
bash scripts/install.sh test,docs,demo,nn
# laplace-torch and posteriors for the comparison tests (torch left alone; fails with the reason if they cannot be
# installed, unless PYRO_SCALABLE_NO_PEERS=1)
bash scripts/install_peers.sh
"$PYTHON" -m pytest "$@"

for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then
        echo "test.sh: test paths given; the second pass against the other ArviZ major is skipped."
        exit 0
    fi
done
if [ "${ONE_ARVIZ:-0}" = "1" ]; then
    exit 0
fi
other=$("$PYTHON" scripts/other_arviz.py .arviz-other | tail -n 1)
version=$(PYTHONPATH="$other" "$PYTHON" -W ignore -c "import arviz; print(arviz.__version__)")
echo "test.sh: the ArviZ-facing tests again, with arviz $version"
PYTHONPATH="$other${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -p no:cacheprovider -m "arviz and not slow"
