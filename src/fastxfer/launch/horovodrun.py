"""The ``horovodrun`` command: ``fastxfer run`` under Horovod's name, so job scripts and
schedulers' templates that call horovodrun run unchanged (docs/launchers.md)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from fastxfer import cli

    return cli.main(["run", *(sys.argv[1:] if argv is None else argv)], prog="horovodrun")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
