#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none): the device tests, then the GPU benchmarks.
#
#     bash benchmarks/gpu_checks.sh [OUT]    # OUT: where the logs and reports go (default benchmarks/results/gpu)
#     STEPS="tests part2 peers" bash benchmarks/gpu_checks.sh    # a subset of: tests part1 part2 step peers sto diagnose
#
# Needs pyro_scalable's dependencies and pytest importable (posteriors is not needed: the sgmcmc-step suite runs
# without its column on a GPU); the steps `step` and `peers` also need jax with CUDA, numpyro and blackjax (they
# compare with JAX on the same GPU). Each step has its own time limit, so that one stuck step leaves the others' results. All steps take
# about 12 minutes on an H100 or H200 (benchmarks/results/*_gpu*.md came from these steps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-benchmarks/results/gpu}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
STEPS=" ${STEPS:-tests part1 part2 step peers sto diagnose} "
status=0
wants() { [[ "$STEPS" == *" $1 "* ]]; }

"$PYTHON" - <<'PY' | tee "$OUT/machine.txt"
import torch, pyro
print(f"torch {torch.__version__}, pyro {pyro.__version__}, CUDA {torch.version.cuda}")
print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY

if wants tests; then
    echo "== device tests (pytest -m cuda)"
    timeout 100 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda -rs \
        tests/test_devices.py tests/bridge/test_checks.py tests/infer/sgmcmc/test_mcmc.py \
        tests/infer/sgmcmc/test_checkpoint.py tests/infer/laplace/test_posterior.py 2>&1 | tee "$OUT/tests.log" | tail -25
    status=$((status | $?))
fi

# the harness's step-cost suites on the GPU (posteriors is left out there); each record goes to
# benchmarks/results/<suite>/cells.jsonl with the device in its machine field, and is copied to OUT
if wants part1; then
    echo "== SG-MCMC on the GPU: one chain against the hand-written loop (the sgmcmc-step suite, smoke size)"
    timeout 150 "$PYTHON" -m benchmarks run sgmcmc-step --device cuda --threads 2 --only ours-step,ours-step-corrected \
        2> "$OUT/sgmcmc_step_gpu.err" | tail -16
    status=$((status | $?))
fi

# the chains at the full size: the smoke size's short and long runs are too few steps apart to time on a GPU
if wants part2; then
    echo "== SG-MCMC on the GPU: 16 vectorised chains against 16 sequential and a hand-written batched loop"
    timeout 110 "$PYTHON" -m benchmarks run sgmcmc-step --device cuda --threads 2 --size full --only ours-16-chains \
        2> "$OUT/sgmcmc_chains_gpu.err" | tail -16
    status=$((status | $?))
fi
cp benchmarks/results/sgmcmc-step/cells.jsonl "$OUT/sgmcmc-step.jsonl" 2> /dev/null

if wants step; then
    echo "== one step, eager and compiled, against the hand-written loop and BlackJAX's jitted step on the same GPU"
    timeout 150 "$PYTHON" -m benchmarks run step-blackjax --device cuda --threads 1 --only step-logistic \
        2> "$OUT/step_blackjax_gpu.err" | tail -14
    status=$((status | $?))
    cp benchmarks/results/step-blackjax/cells.jsonl "$OUT/step-blackjax.jsonl"
fi

if wants peers; then
    echo "== time to accuracy on the GPU: ours against NumPyro NUTS on the same GPU (logistic, d = 10)"
    timeout 170 "$PYTHON" benchmarks/studies/bench_peers.py --device cuda --threads 8 --problems logistic10 \
        --sizes 1e6,1e7 --samplers ours,nuts --budget 60 --nuts-budget 60 --total-budget 2.7 \
        --out "$OUT/peers_gpu.md" 2> "$OUT/peers_gpu.err" | tail -14
    status=$((status | $?))
fi

if wants sto; then
    echo "== sample-then-optimise on the GPU: the step against a forward + backward, memory per sample"
    (cd benchmarks && timeout 170 "$PYTHON" studies/bench_sample_then_optimize_gpu.py \
        --out "$OUT/sample_then_optimize_gpu.md" 2> "$OUT/sto_gpu.err" | tail -14)
    status=$((status | $?))
fi
if wants diagnose; then
    echo "== diagnoses: the compiled step (dynamo's counters, a profile), then where 16 vectorised chains spend a step"
    timeout 120 "$PYTHON" benchmarks/studies/diagnose_compiled_step.py --device cuda > "$OUT/compiled_step_gpu.txt" 2>&1
    status=$((status | $?))
    (timeout 90 "$PYTHON" benchmarks/studies/diagnose_chains_gpu.py > "$OUT/chains_gpu_profile.txt" 2>&1)
    status=$((status | $?))
fi
exit $status
