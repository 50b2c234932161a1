"""Runs several Python scripts one after the other in this one process (started by `fastxfer run`),
so that TensorFlow starts once for all of them: each as its own `__main__` (runpy), with its own
argv and working directory. Usage: run_scripts.py NAME DIR SCRIPT [ARG...] [:: NAME DIR SCRIPT ...].

Each script's output lies between `BEGIN <NAME>` and `END <NAME>` lines (`script_output` in
tests/_launch.py cuts it out). A script that raises (or exits non-zero) ends the job at once with
that exit: the scripts after it do not run, and their tests fail with the job's output."""

import os
import runpy
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def jobs(argv):
    group = []
    for a in argv + ["::"]:
        if a == "::":
            if group:
                if len(group) < 3:
                    raise SystemExit(f"run_scripts.py: want NAME DIR SCRIPT [ARG...], got {group}")
                yield group[0], group[1], group[2], group[3:]
            group = []
        else:
            group.append(a)


def main():
    for name, cwd, script, args in jobs(sys.argv[1:]):
        print(f"BEGIN {name}", flush=True)
        os.chdir(cwd)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"FAILED {name}: exit {e.code}", flush=True)
                raise
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            sys.stdout.flush()
            sys.exit(1)
        finally:
            sys.path.pop(0)
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"END {name}", flush=True)


if __name__ == "__main__":
    main()
