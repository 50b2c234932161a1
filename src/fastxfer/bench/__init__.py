"""Side-by-side benchmarks behind ``fastxfer bench``: each runs fastxfer and the installed peers
in one process tree, on one machine, and reports medians and ratios."""
