"""``python -m fastxfer.settings --markdown``: print docs/configuration.md, generated from the table;
``--check``: validate this environment's FASTXFER_* settings (exit 2 on the first bad one) and list
what is set. (A ``__main__`` of its own: ``fastxfer/__init__.py`` imports the settings at import, so
running the package's module itself with ``-m`` would execute it twice.)"""

from __future__ import annotations

import sys

from fastxfer.settings import SettingError, declaration, markdown, undeclared, validate_all


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if args == ["--check"]:
        try:
            values = validate_all()
        except SettingError as e:
            print(e, file=sys.stderr)
            return 2
        for name, value in values.items():
            shown = "(set, not shown)" if declaration(name).secret else repr(value)
            print(f"{name} = {shown}")
        for name in undeclared():
            print(f"{name}: not a fastxfer setting (ignored)")
        return 0
    print("usage: python -m fastxfer.settings --markdown | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
