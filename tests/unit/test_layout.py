"""The architecture, enforced: the Python package's import graph has no cycle and no module takes
another's private names; each C++ file under csrc/ includes only its own layer or layers below.

Both checkers take a root folder, so they are also run on small trees written here, to show that
they catch what they are meant to catch."""

import ast
import re
from pathlib import Path

import pytest

from _launch import ROOT

SRC = Path(ROOT) / "src"
CSRC = Path(ROOT) / "csrc"

# ---- Python: the import graph ---------------------------------------------------------------


def _modules(src, package):
    """{dotted module name: file} for every .py file of `package` under `src`."""
    mods = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


NATIVE = "_core"  # the compiled module; in a clean checkout it is not built next to the sources


def _is_native(src, dotted):
    """A compiled module (fastxfer._core) is a module too, though it has no .py file."""
    folder = src.joinpath(*dotted.split(".")[:-1])
    name = dotted.split(".")[-1]
    return name == NATIVE or any(folder.glob(f"{name}.pyi")) or any(folder.glob(f"{name}.*.so"))


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Imports(ast.NodeVisitor):
    """Every import of `package` modules in one module, at any depth, and private names taken."""

    def __init__(self, name, is_package, mods, src, package):
        self.name, self.mods, self.src, self.package = name, mods, src, package
        self.here = name if is_package else name.rpartition(".")[0]  # where relative imports start
        self.edges = set()  # (imported module, line)
        self.aliases = {}  # local name -> dotted module it stands for
        self.private = []  # "module:line: what"

    def is_module(self, dotted):
        return dotted in self.mods or _is_native(self.src, dotted)

    def _target(self, dotted, line):
        if dotted in self.mods and dotted != self.name:
            self.edges.add((dotted, line))

    def visit_Import(self, node):
        for a in node.names:
            if a.name == self.package or a.name.startswith(self.package + "."):
                self._target(a.name, node.lineno)
                if a.asname:
                    self.aliases[a.asname] = a.name
                else:  # `import fastxfer.x.y` binds `fastxfer`
                    self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.here.split(".")
            base = base[:len(base) - (node.level - 1)]
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base != self.package and not base.startswith(self.package + "."):
            return
        for a in node.names:
            sub = f"{base}.{a.name}"
            if self.is_module(sub):  # `from pkg import submodule`: private module names are fine
                self._target(sub, node.lineno)
                self.aliases[a.asname or a.name] = sub
            else:
                self._target(base, node.lineno)
                if _private(a.name):
                    self.private.append(f"{self.name}:{node.lineno}: from {base} import {a.name}")

    def visit_Call(self, node):
        # importlib.import_module("pkg.x"), __import__("pkg.x"), import_module(f"pkg.bench.{name}"):
        # a module loaded by name is an import too (the prefix of an f-string names its package)
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            dotted = None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                dotted = arg.value
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                dotted = str(arg.values[0].value).rstrip(".")
            if dotted and (dotted == self.package or dotted.startswith(self.package + ".")):
                while dotted not in self.mods and "." in dotted:
                    dotted = dotted.rpartition(".")[0]
                self._target(dotted, node.lineno)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        chain = []
        cur = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in self.aliases:
            chain.reverse()
            dotted = self.aliases[cur.id]
            for attr in chain:  # walk down through submodules to the first attribute that is not one
                if self.is_module(f"{dotted}.{attr}"):
                    dotted = f"{dotted}.{attr}"
                    continue
                if _private(attr):
                    self.private.append(f"{self.name}:{node.lineno}: {cur.id}...{attr} (a private name of {dotted})")
                break
            return  # the inner Attribute nodes of this chain are done
        self.generic_visit(node)


def import_graph(src, package):
    """({module: {imported module: first line}}, [private-name uses]) for `package` under `src`."""
    mods = _modules(src, package)
    graph, private = {}, []
    for name, path in mods.items():
        v = _Imports(name, path.name == "__init__.py", mods, src, package)
        v.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = {}
        for target, line in sorted(v.edges, key=lambda e: e[1]):
            graph[name].setdefault(target, line)
        private += v.private
    return graph, private


def find_cycle(graph):
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def package_graph(graph, src, package):
    """The import graph between the package's subpackages: each module stands for the subpackage
    of the top level it belongs to (pkg.keras.x -> pkg.keras); modules at the top level stay
    themselves. A cycle here is a circle between layers even where no two modules import each
    other (keras/ reaching into tensorflow/ while tensorflow/ reaches back into keras/)."""
    def node(m):
        parts = m.split(".")
        if len(parts) > 2 or (src.joinpath(*parts) / "__init__.py").is_file():
            return ".".join(parts[:2])
        return m

    out = {}
    for m, targets in graph.items():
        edges = out.setdefault(node(m), {})
        for t, line in targets.items():
            if node(t) != node(m):
                edges.setdefault(node(t), f"{m}:{line}")
    return out


def _describe(graph, cycle):
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_python_package_has_no_import_cycle():
    graph, _ = import_graph(SRC, "fastxfer")
    assert len(graph) > 10 and sum(map(len, graph.values())) > 10  # the checker really read the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + _describe(graph, cycle)


def test_subpackages_import_each_other_in_one_direction_only():
    graph, _ = import_graph(SRC, "fastxfer")
    packages = package_graph(graph, SRC, "fastxfer")
    assert {"fastxfer.keras", "fastxfer.tensorflow", "fastxfer.comm"} <= set(packages)
    assert "fastxfer.tensorflow" in packages["fastxfer.keras"]  # keras/ builds on tensorflow/ ...
    assert "fastxfer.keras" not in packages["fastxfer.tensorflow"]  # ... never the reverse
    cycle = find_cycle(packages)
    assert cycle is None, "import circle between subpackages: " + _describe(packages, cycle)


def test_no_module_takes_another_modules_private_names():
    _, private = import_graph(SRC, "fastxfer")
    assert private == [], "private names used across modules (give them a public name where they live):\n" + \
        "\n".join(private)


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_python_checker_finds_cycles_through_every_kind_of_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/_speedups.pyi": "def g() -> None: ...\n",  # a compiled module: known by its stub
        "pkg/a.py": ("from . import b\nfrom pkg import _core, _speedups\n"
                     "def f():\n    return b.h() + _core.g() + _speedups.g()\n"),
        "pkg/b.py": "def h():\n    from .sub import c  # inside a function: still an import\n    return c.x\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.a as a\nx = a.f\n",
        "pkg/d.py": "from pkg import f  # the package itself\n",
        "pkg/e.py": ("import importlib\ndef g(name):\n    importlib.import_module('pkg.a')\n"
                     "    return importlib.import_module(f'pkg.sub.{name}')\n"),
    })
    graph, private = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 1}  # compiled modules are modules, but not in the graph
    assert graph["pkg.d"] == {"pkg": 1}
    assert graph["pkg.e"] == {"pkg.a": 3, "pkg.sub": 4}  # modules loaded by name
    packages = package_graph(graph, tmp_path, "pkg")
    assert packages["pkg.sub"] == {"pkg.a": "pkg.sub.c:1"} and "pkg.sub" in packages["pkg.b"]
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert private == []
    (tmp_path / "pkg/sub/c.py").write_text("x = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")[0]) is None


def test_python_checker_finds_private_names(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "__version__ = '1'\n",
        "pkg/_util.py": "def _hidden(): ...\ndef shown(): ...\n",
        "pkg/x.py": "def _y(): ...\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/m.py": ("from pkg._util import shown  # a private module, a public name: fine\n"
                         "from pkg import _util, __version__  # a private module itself: fine\n"
                         "from ..x import _y\n"
                         "import pkg.x as k\n"
                         "import pkg.sub\n"
                         "def f():\n"
                         "    return k._y, _util._hidden, pkg.x._y, pkg.sub.m, _util.shown\n"),
    })
    _, private = import_graph(tmp_path, "pkg")
    assert private == ["pkg.sub.m:3: from pkg.x import _y",
                       "pkg.sub.m:7: k..._y (a private name of pkg.x)",
                       "pkg.sub.m:7: _util..._hidden (a private name of pkg._util)",
                       "pkg.sub.m:7: pkg..._y (a private name of pkg.x)"]


# ---- C++: the layers ------------------------------------------------------------------------

# Top-down, as the data flow: a file may include its own folder or a lower rank, never a peer of its
# own rank (transport, fusion and data stay independent of each other; so do kernels and topology).
LAYERS = {
    "bindings": 5, "tfops": 5,
    "engine": 4,
    "collectives": 3,
    "transport": 2, "fusion": 2, "data": 2,
    "kernels": 1, "topology": 1,
    "common": 0,
}
FREE = {"tests"}  # may include anything
SOURCES = {".h", ".hh", ".hpp", ".cc", ".cpp", ".cu", ".inc"}
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def layer_violations(root, layers=LAYERS, free=FREE):
    """Every include under `root` that breaks the layer rule, plus files outside the layer folders."""
    bad = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if path.suffix not in SOURCES:
            continue
        here = rel.parts[0] if len(rel.parts) > 1 else None
        if here in free:
            continue
        if here not in layers:
            bad.append(f"{rel}: not in a layer folder ({', '.join(sorted(layers))})")
            continue
        text = path.read_text(errors="replace")
        for m in INCLUDE.finditer(text):
            inc = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            local = (path.parent / inc).resolve()
            if local.is_file() and local.is_relative_to(root.resolve()):  # relative to the including file
                target = local.relative_to(root.resolve()).parts
            else:  # relative to csrc/, the include root
                target = Path(inc).parts
            there = target[0] if len(target) > 1 else None
            if there == here or there not in layers:
                continue  # own layer, or not ours (a system or third-party header)
            if layers[there] >= layers[here]:
                why = "a peer of the same rank" if layers[there] == layers[here] else "a layer above"
                bad.append(f"{rel}:{line}: includes {inc!r}, {why} ({here} -> {there})")
    return bad


def test_cpp_includes_follow_the_layers():
    assert CSRC.is_dir()
    bad = layer_violations(CSRC)
    assert bad == [], "C++ layer rule (bindings > engine > collectives > transport/fusion/data > " \
                      "kernels/topology > common):\n" + "\n".join(bad)


def test_cpp_checker_on_a_toy_tree(tmp_path):
    _write(tmp_path, {
        "common/dtype.h": "#pragma once\n",
        "kernels/compress.h": '#include "common/dtype.h"\n#include <immintrin.h>\n',
        "topology/topology.cc": '#include "topology.h"\n#include "common/dtype.h"\n',
        "topology/topology.h": "",
        "transport/shm/segment.cc": '#include "segment.h"\n#include "common/dtype.h"\n',
        "transport/shm/segment.h": "",
        "fusion/pack.cc": '#include "kernels/compress.h"\n',
        "collectives/shm_allreduce.cc": '#include "transport/shm/segment.h"\n#include "fusion/pack.h"\n',
        "engine/engine.cc": '#include "collectives/shm_allreduce.h"\n#include "topology/topology.h"\n',
        "bindings/module.cc": '#include "engine/engine.h"\n#include "pybind11/pybind11.h"\n',
        "tests/test_core.cc": '#include "bindings/module.h"\n',
        "README.md": '#include "engine/engine.h"\n',  # not a source file
    })
    assert layer_violations(tmp_path) == []
    _write(tmp_path, {
        "transport/shm/segment.h": '#include "engine/engine.h"\n#include "../../collectives/collectives.h"\n',
        "fusion/pack.h": '\n#include "data/jpeg.h"\n',
        "kernels/reduce.h": '#include "topology/topology.h"\n',
        "common/errors.h": '#  include "kernels/compress.h"\n',
        "collectives/collectives.h": "",
        "stray.cc": "",
        "compress/old.cc": "",
    })
    assert layer_violations(tmp_path) == [
        "common/errors.h:1: includes 'kernels/compress.h', a layer above (common -> kernels)",
        "compress/old.cc: not in a layer folder (bindings, collectives, common, data, engine, fusion, kernels, "
        "tfops, topology, transport)",
        "fusion/pack.h:2: includes 'data/jpeg.h', a peer of the same rank (fusion -> data)",
        "kernels/reduce.h:1: includes 'topology/topology.h', a peer of the same rank (kernels -> topology)",
        "stray.cc: not in a layer folder (bindings, collectives, common, data, engine, fusion, kernels, tfops, "
        "topology, transport)",
        "transport/shm/segment.h:1: includes 'engine/engine.h', a layer above (transport -> engine)",
        "transport/shm/segment.h:2: includes '../../collectives/collectives.h', a layer above "
        "(transport -> collectives)",
    ]


@pytest.mark.parametrize("here,there,ok", [("engine", "engine", True), ("engine", "common", True),
                                           ("tfops", "bindings", False), ("data", "fusion", False),
                                           ("common", "kernels", False), ("bindings", "tfops", False)])
def test_cpp_layer_rule_pairs(tmp_path, here, there, ok):
    _write(tmp_path, {f"{here}/a.cc": f'#include "{there}/b.h"\n', f"{there}/b.h": ""})
    assert (layer_violations(tmp_path) == []) is ok


# ---- docs/architecture.md: the module table is complete ----------------------------------------


def module_table_rows(text):
    """{first cell: rest of the row} of the table under "| package / module | what |"."""
    lines = text.split("| package / module | what |", 1)[1].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        first, rest = line.strip("|").split("|", 1)
        rows[first.strip()] = rest
    return rows


def modules_missing_from_table(src, package, text):
    """Every .py file of `package` that the table does not name: a top-level module needs a row
    of its own (`name.py`), a module of a subpackage its name (`name.py`) in its folder's row."""
    rows = module_table_rows(text)
    missing = []
    for path in sorted((src / package).rglob("*.py")):
        rel = path.relative_to(src / package)
        name = f"`{rel.name}`"
        if len(rel.parts) == 1:
            if not any(name in first for first in rows):
                missing.append(str(rel))
        elif name not in rows.get(f"`{rel.parent.as_posix()}/`", ""):
            missing.append(str(rel))
    return missing


def test_architecture_doc_names_every_module():
    text = (Path(ROOT) / "docs" / "architecture.md").read_text()
    assert len(module_table_rows(text)) > 10
    assert modules_missing_from_table(SRC, "fastxfer", text) == []


def test_module_table_check_finds_a_missing_module(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "", "pkg/sub/__init__.py": "", "pkg/sub/b.py": "",
                      "pkg/sub/c.py": ""})
    text = ("| package / module | what |\n|---|---|\n| `__init__.py`, `a.py` | x |\n"
            "| `sub/` | `__init__.py`, `b.py` (the b) |\n\nafter")
    assert modules_missing_from_table(tmp_path, "pkg", text) == ["sub/c.py"]



# ---- C++: no environment --------------------------------------------------------------------

GETENV = re.compile(r"\b(?:secure_)?getenv\b|\benviron\b")


def environment_reads(root, free=FREE):
    """Every line of a C++ source under `root` (outside the free folders) that reads the environment."""
    bad = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCES):
        rel = path.relative_to(root)
        if rel.parts[0] in free:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if GETENV.search(line):
                bad.append(f"{rel}:{n}: {line.strip()}")
    return bad


def test_cpp_core_reads_no_environment_variable():
    """Settings reach the core from Python (fastxfer/settings.py, declared once): _core.configure at
    import, the engine's job configuration at init(). The C++ tests may set what they like."""
    bad = environment_reads(CSRC)
    assert bad == [], "the C++ core must not read the environment (declare the setting in " \
                      "src/fastxfer/settings.py and pass its value in):\n" + "\n".join(bad)


def test_environment_checker_on_a_toy_tree(tmp_path):
    _write(tmp_path, {
        "engine/engine.h": 'bool y = std::getenv("FASTXFER_YIELD") != nullptr;\n',
        "kernels/dispatch.cc": "// a getenvelope is not a call\nextern char** environ;\n",
        "common/ok.cc": "int x = 1;\n",
        "tests/test_core.cc": 'setenv("X", "1", 1); getenv("X");\n',
    })
    assert environment_reads(tmp_path) == [
        'engine/engine.h:1: bool y = std::getenv("FASTXFER_YIELD") != nullptr;',
        "kernels/dispatch.cc:2: extern char** environ;",
    ]
