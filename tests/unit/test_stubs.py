"""The type stubs shipped for the native module (`_core.pyi`, with `py.typed`): every name the module
has is declared, with the classes' public members, so type checkers see the whole API."""

import ast
import os

import fastxfer
from fastxfer import _core

PKG = os.path.dirname(fastxfer.__file__)


def _stub() -> ast.Module:
    with open(os.path.join(PKG, "_core.pyi")) as f:
        return ast.parse(f.read())


def _names(body) -> set[str]:
    out = set()
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))


def test_every_name_of_the_native_module_is_in_its_stub():
    tree = _stub()
    declared = _names(tree.body)
    runtime = {n for n in dir(_core) if not n.startswith("__")} | {"__version__"}
    assert sorted(runtime - declared) == [], "names of fastxfer._core missing from _core.pyi"
    assert sorted(declared - runtime) == [], "names in _core.pyi that fastxfer._core does not have"
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        members = {m for m in dir(getattr(_core, cls.name)) if not m.startswith("_")}
        missing = members - _names(cls.body)
        assert sorted(missing) == [], f"{cls.name}: public members missing from _core.pyi"
