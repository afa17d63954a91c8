#!/usr/bin/env bash
# Install the comparison peers -- laplace-torch 0.3 (with its default curvature backend, curvlinops) and
# posteriors -- into the current Python ($PYTHON, default python3), never touching the installed torch.
#
# Idempotent: when everything is there already it only reads package metadata (well under a second).
# Fails (exit 1) with the reason if torch is missing, the package index cannot be reached, an install goes wrong or
# laplace-torch does not import: the comparison tests (tests/infer/laplace/test_laplace_torch.py) are the evidence
# for rows of the README, so a test run without them must say so. PYRO_SCALABLE_NO_PEERS=1 skips this script (and
# those tests) on purpose, e.g. offline.
#
# Why --no-deps for the laplace stack: laplace-torch 0.3 imports its asdl, backpack and curvlinops backends at
# module level (laplace/baselaplace.py), so all three are needed for `import laplace`, but backpack-for-pytorch
# declares torchvision, and a torchvision that does not match the installed torch breaks `import laplace`. The
# list below is the import closure of `import laplace` (checked by blocking each module in turn), so nothing
# else is pulled in, and pip cannot swap torch. posteriors installs with its dependencies, torch pinned to the
# installed version by a constraint file.
set -uo pipefail
PYTHON=${PYTHON:-python3}

fail() {
    echo "install_peers.sh: ERROR: $*. The comparisons with laplace-torch/posteriors need them; set" \
        "PYRO_SCALABLE_NO_PEERS=1 to test without them." >&2
    exit 1
}
if [ "${PYRO_SCALABLE_NO_PEERS:-0}" = "1" ]; then
    echo "install_peers.sh: PYRO_SCALABLE_NO_PEERS=1: the comparison peers are not installed." >&2
    exit 0
fi

# distribution==version pins for the curvature packages (the versions the comparison was made with); lower
# bounds for the general-purpose ones, so that an installed numpy or scipy is left alone.
LAPLACE_STACK=(
    "laplace-torch==0.3"
    "asdfghjkl==0.1a4"              # provides the `asdl` module
    "backpack-for-pytorch==1.7.1"
    "curvlinops-for-pytorch==3.0.1"
    "einconv==0.1.0"
    "unfoldNd==0.2.3"
    "linear_operator==0.6.1"
    "einops>=0.3,<1"
    "opt-einsum>=3.4"
    "torchmetrics>=1.0"
    "lightning-utilities>=0.15.3"
    "packaging>=22"
    "typing_extensions>=4"
    "scipy>=1.12"
    "numpy>=1.24"
    "tqdm>=4.60"
)
POSTERIORS="posteriors>=0.1.3"

# 0: all present; 1: something to install (or state unknown); 2: only a torchvision to remove.
state() {
    "$PYTHON" - "${LAPLACE_STACK[@]}" "$POSTERIORS" <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement

missing = []
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(spec)
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{spec} (have {version})")
if missing:
    print("install_peers.sh: to install:", ", ".join(missing), file=sys.stderr)
    sys.exit(1)
sys.exit(2 if importlib.util.find_spec("torchvision") is not None else 0)
EOF
}

state
status=$?
[ "$status" -eq 0 ] && exit 0
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    fail "torch is not importable by $PYTHON (install the package first: scripts/install.sh)"
fi

if [ "$status" -eq 1 ]; then
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    "$PYTHON" -c "import torch; print(f'torch=={torch.__version__}')" >"$constraints"
    pip_opts=(--quiet --timeout 30 --retries 2 --disable-pip-version-check -c "$constraints")
    if ! "$PYTHON" -m pip install "${pip_opts[@]}" --no-deps "${LAPLACE_STACK[@]}"; then
        fail "pip could not install laplace-torch and its backends (is the package index reachable?)"
    fi
    if ! "$PYTHON" -m pip install "${pip_opts[@]}" "$POSTERIORS"; then
        fail "pip could not install $POSTERIORS (is the package index reachable?)"
    fi
fi

# A torchvision built for another torch (backpack-for-pytorch asks for one) breaks `import laplace`.
if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)" 2>/dev/null; then
    "$PYTHON" -m pip uninstall --quiet -y torchvision || fail "could not uninstall torchvision"
fi

if ! err=$("$PYTHON" -c "import laplace; from laplace.curvature import CurvlinopsGGN" 2>&1); then
    fail "laplace-torch is installed but does not import: $(echo "$err" | tail -n 1)"
fi
exit 0
