"""Side-by-side benchmarks behind ``fastxfer bench``: each runs fastxfer and the installed peers
in one process tree, on one machine, and reports medians and ratios.

One module per benchmark (``compress``, ``allreduce``, ``pipeline``, ``placement``, ``train``: the
driver, with ``add_arguments`` and ``main``), the shared ``harness`` (timing, machine description,
targets, tables, JSON, plots, starting workers), ``simhosts`` (simulated hosts in network
namespaces, for ``allreduce --hosts`` and the multi-host tests), and ``workers/``: the child
programs the drivers start, one module per benchmark."""
