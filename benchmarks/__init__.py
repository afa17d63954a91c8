"""The benchmarks: a registry of problems, engines and metrics, suites of cells, and the page rendered from them.

    python -m benchmarks list                          # the suites and their cells
    python -m benchmarks run peers                     # smoke size: a minute or two on 2 CPU cores
    python -m benchmarks run peers --size full --budget 600 --only ours-sghmc,numpyro-nuts
    python -m benchmarks render                        # docs/benchmarks.md's tables from the latest records
    python -m benchmarks posteriordb run | advised | report   # every engine on posteriordb's posteriors
    python -m benchmarks zoo-seeds --kernels SGHMC --seeds 10  # the default kernels on the test zoo over seeds

Modules: ``problems`` (data, models, references), ``engines`` (ours and the peers), ``metrics``, ``suites``,
``records`` (one JSON line per cell), ``render``, ``posteriordb`` and ``zoo`` (the external and the zoo accuracy
suites, their own cells and reports). ``harness`` holds the timing, load and memory probes the engines and the
studies share; ``studies/`` holds experiments that explain one figure or reproduce a published one.
"""
