#!/usr/bin/env bash
# Part 2 of bench_sgmcmc.py on a GPU for the working tree and for an earlier package, interleaved in one call:
# after, before, after (the 16-chain throughputs drift by ±15% between runs on the same GPU; the ratios within a
# run less). The earlier package comes from git where git history is at hand, before the call:
#
#     mkdir -p .base && git archive <commit> pyro_scalable | tar -x -C .base     # ignored (.git/info/exclude)
#     bash benchmarks/gpu_part2_before_after.sh .base [OUT]                      # OUT: default benchmarks/results/gpu
#
# About 3 minutes on an H100. The benchmark script is the working tree's in both. DEVICE=cpu EXTRA=--quick runs
# the same comparison on the CPU (a smoke test of this script).
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=$(realpath "$1")
OUT=$(realpath -m "${2:-benchmarks/results/gpu}")
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd benchmarks
status=0
for run in after before after_again; do
    echo "== part 2, $run"
    if [ "$run" = before ]; then path=$BASE; else path=$(realpath ..); fi
    PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" timeout "${LIMIT:-100}" "$PYTHON" bench_sgmcmc.py --device "${DEVICE:-cuda}" \
        --parts 2 --without-posteriors ${EXTRA:-} --out "$OUT/sgmcmc_gpu_part2_$run.md" 2>> "$OUT/part2.err" | tail -7
    status=$((status | $?))
done
exit $status
