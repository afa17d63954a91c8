#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none): the device tests, then the GPU benchmarks.
#
#     bash benchmarks/gpu_checks.sh [OUT]    # OUT: where the logs and reports go (default benchmarks/results/gpu)
#
# Needs pyro_scalable's dependencies and pytest importable (posteriors is not needed: bench_sgmcmc runs without its
# column). Each step has its own time limit, so that one stuck step leaves the others' results. About 8 minutes
# on an H100 (benchmarks/results/*_gpu*.md came from these steps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-benchmarks/results/gpu}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
status=0

"$PYTHON" - <<'EOF' | tee "$OUT/machine.txt"
import torch, pyro
print(f"torch {torch.__version__}, pyro {pyro.__version__}, CUDA {torch.version.cuda}")
print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF

echo "== device tests (pytest -m cuda)"
timeout 90 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda -rs \
    tests/test_devices.py tests/bridge/test_checks.py tests/infer/sgmcmc/test_mcmc.py \
    tests/infer/sgmcmc/test_checkpoint.py tests/infer/laplace/test_posterior.py 2>&1 | tee "$OUT/tests.log" | tail -25
status=$((status | $?))

echo "== SG-MCMC on the GPU: one chain against the hand-written loop (part 1, quick)"
(cd benchmarks && timeout 150 "$PYTHON" bench_sgmcmc.py --device cuda --quick --reps 3 --parts 1 --without-posteriors \
    --out "$OUT/sgmcmc_gpu_quick.md" 2> "$OUT/sgmcmc_gpu_quick.err" | tail -16)
status=$((status | $?))

# part 2 in its full size: the quick run's short and long runs are too few steps apart to time on a GPU
echo "== SG-MCMC on the GPU: 16 vectorised chains against 16 sequential and a hand-written batched loop (part 2)"
(cd benchmarks && timeout 120 "$PYTHON" bench_sgmcmc.py --device cuda --parts 2 --without-posteriors \
    --out "$OUT/sgmcmc_gpu_part2.md" 2> "$OUT/sgmcmc_gpu_part2.err" | tail -16)
status=$((status | $?))

echo "== sample-then-optimise on the GPU: the step against a forward + backward, memory per sample"
(cd benchmarks && timeout 170 "$PYTHON" bench_sample_then_optimize_gpu.py \
    --out "$OUT/sample_then_optimize_gpu.md" 2> "$OUT/sto_gpu.err" | tail -14)
status=$((status | $?))
exit $status
