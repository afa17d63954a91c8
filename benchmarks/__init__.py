"""The benchmarks: a registry of problems, engines and metrics, suites of cells, and the page rendered from them.

    python -m benchmarks list                          # the suites and their cells
    python -m benchmarks run peers                     # smoke size: a minute or two on 2 CPU cores
    python -m benchmarks run peers --size full --budget 600 --only ours-sghmc,numpyro-nuts
    python -m benchmarks render                        # docs/benchmarks.md's tables from the latest records

Modules: ``problems`` (data, models, references), ``engines`` (ours and the peers), ``metrics``, ``suites``,
``records`` (one JSON line per cell), ``render``. ``harness`` holds the load and memory probes the older
``bench_*.py`` scripts share; ``studies/`` holds experiments that explain one figure.
"""
