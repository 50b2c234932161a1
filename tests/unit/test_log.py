"""The `fastxfer` logger (fastxfer/log.py): its level from FASTXFER_LOG_LEVEL or HOROVOD_LOG_LEVEL,
handed to the native core too; its own stderr line only while the application configured no
logging; the rank in every line."""

import os
import subprocess
import sys

import pytest

SAY = ("import logging, sys\n"
       "if sys.argv[1] == 'root': logging.basicConfig(format='ROOT %(levelname)s %(message)s')\n"
       "import fastxfer\n"
       "from fastxfer import _core\n"
       "from fastxfer.log import logger\n"
       "logger.info('an info line')\n"
       "logger.warning('a warning line')\n"
       "print(_core.log_level())\n")


def say(env, mode="plain"):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FASTXFER_", "HOROVOD_", "OMPI_", "PMI_",
                                                                     "SLURM_"))}
    e.pop("RANK", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", SAY, mode], capture_output=True, text=True, timeout=120, env=e)


@pytest.mark.parametrize("env, level", [({}, 30), ({"FASTXFER_LOG_LEVEL": "info"}, 20),
                                        ({"FASTXFER_LOG_LEVEL": "critical"}, 50),
                                        ({"HOROVOD_LOG_LEVEL": "fatal"}, 50), ({"HOROVOD_LOG_LEVEL": "trace"}, 10),
                                        ({"FASTXFER_LOG_LEVEL": "error", "HOROVOD_LOG_LEVEL": "debug"}, 40)])
def test_the_level_reaches_the_logger_and_the_native_core(env, level):
    r = say(env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(level)]  # _core.log_level(): the native core's threshold
    assert ("fastxfer[rank -] WARNING: a warning line" in r.stderr) == (level <= 30), r.stderr
    assert ("fastxfer[rank -] INFO: an info line" in r.stderr) == (level <= 20), r.stderr


def test_lines_carry_the_launchers_rank_and_yield_to_the_applications_logging():
    r = say({"FASTXFER_RANK": "3"})
    assert r.stderr.strip().splitlines()[-1] == "fastxfer[rank 3] WARNING: a warning line", r.stderr
    r = say({"FASTXFER_RANK": "3"}, mode="root")
    assert "ROOT WARNING a warning line" in r.stderr and "fastxfer[rank" not in r.stderr, r.stderr
    assert r.stderr.count("a warning line") == 1


def test_a_bad_level_fails_the_import_in_one_line():
    r = say({"FASTXFER_LOG_LEVEL": "loud"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("fastxfer: FASTXFER_LOG_LEVEL='loud': expected one of debug, info, warning")
