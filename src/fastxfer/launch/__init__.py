"""The launcher behind ``fastxfer run``: ``main`` parses its command line once and picks the mode,
one module per way of starting workers (``local``, ``mpirun``, ``elastic``) on what they share
(``job``: worker processes and how they stop; ``output``: prefixed output, last lines, exit codes),
and ``bind``, the exec helper each worker starts through under ``--bind``."""
