"""The benchmarks' child programs, one module per benchmark, started by the drivers in
``fastxfer.bench`` as ``python -m fastxfer.bench.workers.<name>`` (under ``fastxfer run``, mpirun
or on their own). Each writes its result as JSON for the driver to read."""
