#!/usr/bin/env bash
# Root only, before the README's test command (called by .ci/run): the launchers the launcher tests
# run for real (tests/multiproc/test_launchers.py), each where those tests look for it:
#   Slurm (slurmctld, slurmd, srun), munge and PMIx   Debian's packages (the tests start a one-node
#                                                     cluster of their own and stop it)
#   MPICH's and Intel MPI's mpiexec                   their PyPI wheels, in /opt/fastxfer-ci/{mpich,impi}
#   torchrun                                          torch from PyPI, in /opt/fastxfer-ci/torch (--target:
#                                                     the tests put it on PYTHONPATH for torchrun only)
# Each step is skipped when already done (a machine that ran it before).
set -euo pipefail
PREFIX=/opt/fastxfer-ci
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || [ ! -e /usr/lib/x86_64-linux-gnu/libpmix.so ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmd slurmctld slurm-client munge libpmix-dev
fi
mkdir -p "$PREFIX"
if [ ! -x "$PREFIX/tools/bin/pip" ]; then
  python3 -m venv "$PREFIX/tools"
fi
[ -x "$PREFIX/mpich/bin/mpiexec" ] || "$PREFIX/tools/bin/pip" install -q --prefix "$PREFIX/mpich" mpich
[ -x "$PREFIX/impi/bin/mpiexec" ] || "$PREFIX/tools/bin/pip" install -q --prefix "$PREFIX/impi" impi-rt
[ -d "$PREFIX/torch/torch" ] || "$PREFIX/tools/bin/pip" install -q --target "$PREFIX/torch" torch
echo "launchers ready: $(srun --version), MPICH $(ls "$PREFIX"/mpich/lib/libmpi.so.12), Intel MPI $(ls "$PREFIX"/impi/lib/libmpi.so.12), torch in $PREFIX/torch"
