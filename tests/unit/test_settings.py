"""fastxfer.settings: every FASTXFER_* variable declared once, parsed and validated in one place, refused
with one line naming it; docs/configuration.md generated from the table."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastxfer as fx
from fastxfer import _configure, _core, settings
from fastxfer._validate import BUCKET_CAP_MB_RANGE
from fastxfer.settings import SettingError

from _launch import ROOT

DOC = Path(ROOT) / "docs" / "configuration.md"
TABLE = settings.table()


@pytest.fixture
def clean_env(monkeypatch):
    """No FASTXFER_* variable set (the suite's environment may carry some)."""
    for name in list(os.environ):
        if name.startswith("FASTXFER_"):
            monkeypatch.delenv(name)
    return monkeypatch


# ---- the table -------------------------------------------------------------------------------

def test_the_table_declares_every_setting_once_with_all_its_fields():
    names = [s.name for s in TABLE]
    assert len(names) == len(set(names)) >= 30
    for s in TABLE:
        assert s.name.startswith("FASTXFER_") and s.name.upper() == s.name
        assert s.type in ("int", "float", "bool", "switch", "choice", "text"), s.name
        assert s.set_by in (settings.USER, settings.LAUNCHER), s.name
        assert s.meaning and "\n" not in s.meaning, s.name
        assert s.accepted() and s.default_in_words(), s.name
        assert s.bad, f"{s.name} has no example of a refused value"


def test_the_launchers_variables_are_marked_as_set_by_it():
    launcher = {s.name for s in TABLE if s.set_by == settings.LAUNCHER}
    assert {"FASTXFER_RANK", "FASTXFER_SIZE", "FASTXFER_LOCAL_RANK", "FASTXFER_LOCAL_SIZE", "FASTXFER_JOB_ID",
            "FASTXFER_JOB_SECRET", "FASTXFER_ELASTIC_SOCKET", "FASTXFER_REPORT_DIR", "FASTXFER_WORKER_ID"} <= launcher
    assert "FASTXFER_THREADS" not in launcher and "FASTXFER_TIMEOUT" not in launcher


def test_docs_configuration_md_is_generated_from_the_table():
    assert DOC.read_text() == settings.markdown(), (
        "docs/configuration.md and fastxfer/settings.py differ: regenerate it with "
        "`python -m fastxfer.settings --markdown > docs/configuration.md`")
    for s in TABLE:
        assert f"`{s.name}`" in DOC.read_text()


def test_markdown_command_prints_the_page(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastxfer.settings", "--markdown"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == settings.markdown()


def test_an_undeclared_name_is_a_key_error():
    with pytest.raises(KeyError, match="FASTXFER_NOPE is not a declared fastxfer setting"):
        settings.get("FASTXFER_NOPE")


# ---- every declared variable: its default, and its example of a bad value -----------------------

@pytest.mark.parametrize("s", TABLE, ids=lambda s: s.name)
def test_each_setting_refuses_its_bad_example_naming_the_variable(s, clean_env):
    clean_env.setenv(s.name, s.bad)
    with pytest.raises(SettingError) as e:
        settings.get(s.name)
    msg = str(e.value)
    assert msg.startswith(f"{s.name}=") and "\n" not in msg
    assert f"expected {s.accepted()}" in msg
    assert (repr(s.bad) in msg) != s.secret  # the value, unless it is a secret
    assert isinstance(e.value, ValueError) and isinstance(e.value, fx.FastxferError)
    with pytest.raises(SettingError, match=s.name):
        settings.validate_all()


@pytest.mark.parametrize("s", TABLE, ids=lambda s: s.name)
def test_each_setting_unset_or_blank_is_its_default(s, clean_env):
    default = settings.get(s.name)
    want = settings.get(s.default_from) if s.default_from else s.default
    assert default == want
    clean_env.setenv(s.name, "  ")
    assert settings.get(s.name) == default and not settings.is_set(s.name)


# ---- the cases that used to slip through ---------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "-3", "4x", "0", "2.5", "99999"])
def test_threads_refuses_garbage_negative_and_trailing_letters(value, clean_env):
    """Before: abc and -3 silently used the CPU count, 4x became 4."""
    clean_env.setenv("FASTXFER_THREADS", value)
    with pytest.raises(SettingError, match=rf"^FASTXFER_THREADS='{value}': expected an integer between 1 and 4096 "):
        settings.get("FASTXFER_THREADS")


@pytest.mark.parametrize("text, want", [("4", 4), (" 8 ", 8), ("+2", 2)])
def test_threads_accepts_integers(text, want, clean_env):
    clean_env.setenv("FASTXFER_THREADS", text)
    assert settings.get("FASTXFER_THREADS") == want


@pytest.mark.parametrize("name", ["FASTXFER_TIMEOUT", "FASTXFER_ELASTIC_TIMEOUT", "FASTXFER_ATTACH_TIMEOUT",
                                  "FASTXFER_STALL_WARNING_S", "FASTXFER_HOST_TIMEOUT", "FASTXFER_GRACE",
                                  "FASTXFER_STREAM_MIN_MB", "FASTXFER_OUTPUT_POOL_MB", "FASTXFER_SPIN_US"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "abc", "1s"])
def test_numbers_refuse_nan_inf_negative_and_garbage(name, value, clean_env):
    """Before: FASTXFER_TIMEOUT=nan turned stall detection off, FASTXFER_GRACE=abc was a traceback,
    FASTXFER_STREAM_MIN_MB=-1 was accepted."""
    clean_env.setenv(name, value)
    with pytest.raises(SettingError, match=rf"^{name}='{value}': expected a number"):
        settings.get(name)


@pytest.mark.parametrize("value", ["0", "-1", "0.0"])
def test_elastic_timeout_refuses_zero_and_negative(value, clean_env):
    """Before: 0 or -1 made the elastic launcher kill every survivor at once."""
    clean_env.setenv("FASTXFER_ELASTIC_TIMEOUT", value)
    with pytest.raises(SettingError, match=r"expected a number > 0"):
        settings.get("FASTXFER_ELASTIC_TIMEOUT")


def test_elastic_timeout_defaults_to_the_timeout(clean_env):
    assert settings.get("FASTXFER_ELASTIC_TIMEOUT") == 300.0
    clean_env.setenv("FASTXFER_TIMEOUT", "42")
    assert settings.get("FASTXFER_ELASTIC_TIMEOUT") == 42.0
    clean_env.setenv("FASTXFER_ELASTIC_TIMEOUT", "7.5")
    assert settings.get("FASTXFER_ELASTIC_TIMEOUT") == 7.5


def test_bucket_cap_has_the_range_of_the_api_argument(clean_env):
    """Before: FASTXFER_BUCKET_CAP_MB=100000 was accepted where init(bucket_cap_mb=100000) is refused."""
    d = settings.declaration("FASTXFER_BUCKET_CAP_MB")
    assert (d.low, d.high) == BUCKET_CAP_MB_RANGE
    for bad in ("100000", "0", "0.0001"):
        clean_env.setenv("FASTXFER_BUCKET_CAP_MB", bad)
        with pytest.raises(SettingError, match=r"expected a number between 1/1024 and 4096"):
            settings.get("FASTXFER_BUCKET_CAP_MB")
    for good, want in (("4096", 4096.0), ("0.5", 0.5), (str(1 / 1024), 1 / 1024)):
        clean_env.setenv("FASTXFER_BUCKET_CAP_MB", good)
        assert settings.get("FASTXFER_BUCKET_CAP_MB") == want


@pytest.mark.parametrize("value, want", [("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False),
                                         ("no", False)])
def test_switches(value, want, clean_env):
    clean_env.setenv("FASTXFER_YIELD", value)
    assert settings.get("FASTXFER_YIELD") is want
    clean_env.setenv("FASTXFER_TF_PIN", value)
    assert settings.get("FASTXFER_TF_PIN") is want
    clean_env.setenv("FASTXFER_TF_PIN", "Auto")
    assert settings.get("FASTXFER_TF_PIN") == "auto"


def test_text_values(clean_env, tmp_path):
    clean_env.setenv("FASTXFER_ENGINE_CPUS", "0-1,3")
    assert settings.get("FASTXFER_ENGINE_CPUS") == [0, 1, 3]
    clean_env.setenv("FASTXFER_SHM_DIR", str(tmp_path) + "/")
    assert settings.get("FASTXFER_SHM_DIR") == str(tmp_path)
    clean_env.setenv("FASTXFER_SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(SettingError, match="the absolute path of an existing directory"):
        settings.get("FASTXFER_SHM_DIR")
    clean_env.setenv("FASTXFER_HOST_ID", "h1")
    assert settings.get("FASTXFER_HOST_ID") == "h1"
    clean_env.setenv("FASTXFER_HOST_ID", "a\nb")  # the heartbeats' messages are lines
    with pytest.raises(SettingError):
        settings.get("FASTXFER_HOST_ID")
    clean_env.setenv("FASTXFER_JOB_ID", "123-abc")
    assert settings.get("FASTXFER_JOB_ID") == "123-abc"


def test_a_secret_is_never_repeated(clean_env):
    secret = "0123456789abcdef" * 1 + " with a space in it, long enough"
    clean_env.setenv("FASTXFER_JOB_SECRET", secret)
    with pytest.raises(SettingError) as e:
        settings.get("FASTXFER_JOB_SECRET")
    assert secret not in str(e.value) and "not shown" in str(e.value)


def test_validate_all_returns_what_is_set_and_stops_at_the_first_bad_value():
    env = {"FASTXFER_THREADS": "2", "FASTXFER_TIMEOUT": "10", "PATH": "/bin"}
    assert settings.validate_all(env) == {"FASTXFER_THREADS": 2, "FASTXFER_TIMEOUT": 10.0}
    env.update(FASTXFER_TIMEOUT="nan", FASTXFER_TF_PIN="sometimes")
    with pytest.raises(SettingError, match="^FASTXFER_TIMEOUT='nan'"):  # the table's order
        settings.validate_all(env)


def test_undeclared_names_are_listed():
    assert settings.undeclared({"FASTXFER_THREAD": "2", "FASTXFER_THREADS": "2", "OMP_NUM_THREADS": "1"}) == \
        ["FASTXFER_THREAD"]


# ---- where values are checked and applied ----------------------------------------------------------

@pytest.mark.parametrize("name, value", [("FASTXFER_TIMEOUT", "nan"), ("FASTXFER_GRACE", "abc"),
                                         ("FASTXFER_TF_PIN", "sometimes"), ("FASTXFER_STREAM_MIN_MB", "-1")])
def test_init_refuses_a_bad_value_first(name, value, clean_env):
    """One clear error at init (even for a setting init itself does not use), never a traceback from inside."""
    clean_env.setenv(name, value)
    with pytest.raises(SettingError, match=f"^{name}='{value}'"):
        fx.init()
    assert not fx.is_initialized()


def _import(env_extra, code="import fastxfer"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTXFER_")}
    return subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_kernel_settings_are_applied_at_import():
    r = _import({"FASTXFER_THREADS": "3", "FASTXFER_OUTPUT_POOL_MB": "2", "FASTXFER_SIMD": "scalar"},
                "import fastxfer as fx; from fastxfer import _core; "
                "print(_core.default_threads(), _core.output_pool_stats()['cap_bytes'], fx.simd_level())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", str(2 << 20), "scalar"]


@pytest.mark.parametrize("name, value", [("FASTXFER_THREADS", "abc"), ("FASTXFER_THREADS", "-3"),
                                         ("FASTXFER_SIMD", "avx9000"), ("FASTXFER_OUTPUT_POOL_MB", "nan")])
def test_a_bad_kernel_setting_fails_the_import_with_one_line(name, value):
    r = _import({name: value})
    assert r.returncode == 2  # uncaught: one line and exit code 2, no traceback
    assert r.stderr.strip().startswith(f"fastxfer: {name}='{value}': expected "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("env, argv", [
    ({"FASTXFER_GRACE": "abc"}, ["--version"]),
    ({"FASTXFER_THREADS": "abc"}, ["run", "-np", "2", "--", sys.executable, "-c", "import fastxfer as f; f.init()"]),
    ({"FASTXFER_TIMEOUT": "nan"}, ["run", "-np", "2", "--", "true"]),
    ({"FASTXFER_TF_PIN": "sometimes"}, ["topo"]),
])
def test_the_command_line_refuses_a_bad_setting_with_one_line_and_exit_code_2(env, argv):
    r = subprocess.run([shutil.which("fastxfer") or "fastxfer", *argv], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=120)
    (name, value), = env.items()
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(f"fastxfer: {name}='{value}'"), \
        r.stderr
    assert r.stdout == ""


def test_a_level_this_cpu_cannot_run_is_a_setting_error(monkeypatch):
    def refuse(**kw):
        raise ValueError("SIMD level 'avx512bf16' is not supported on this CPU")

    monkeypatch.setenv("FASTXFER_SIMD", "avx512bf16")
    monkeypatch.setattr(_core, "configure", refuse)
    with pytest.raises(SettingError, match=r"^FASTXFER_SIMD='avx512bf16': expected a path this CPU supports, "
                                           r"one of scalar"):
        _configure.configure_core()


# ---- nothing else reads a FASTXFER_* variable (in the converted parts of the package) ---------------

CONVERTED = ["comm", "data", "bench", "tensorflow", "keras", "launch", "topology.py", "__init__.py", "_configure.py",
             "compression.py", "fusion.py", "_validate.py", "errors.py", "cli.py", "elastic.py"]


def _direct_reads(path: Path) -> list[str]:
    """`os.environ.get("FASTXFER_...")`, `os.getenv(...)`, `os.environ["FASTXFER_..."]` (read) and
    `"FASTXFER_..." in os.environ` in one module."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def fastxfer_str(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("FASTXFER_")

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" or \
            isinstance(node, ast.Name) and node.id == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and fastxfer_str(node.args[0]):
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "getenv" or f.attr == "get" and is_environ(f.value)):
                out.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value) \
                and fastxfer_str(node.slice):
            out.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Compare) and fastxfer_str(node.left) and any(is_environ(c) for c in node.comparators):
            out.append(f"{path}:{node.lineno}")
    return out


def test_the_checker_finds_direct_reads(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('import os\nos.environ.get("FASTXFER_A")\nos.getenv("FASTXFER_B", "1")\nx = os.environ["FASTXFER_C"]\n'
                 'y = "FASTXFER_D" in os.environ\nos.environ["FASTXFER_E"] = "1"\nos.environ.get("OMP_NUM_THREADS")\n')
    assert [r.rsplit(":", 1)[1] for r in _direct_reads(p)] == ["2", "3", "4", "5"]


def test_converted_modules_read_settings_only_through_fastxfer_settings():
    pkg = Path(fx.__file__).parent
    src = Path(ROOT) / "src" / "fastxfer"
    base = src if src.is_dir() else pkg
    found = []
    for rel in CONVERTED:
        target = base / rel
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            found += _direct_reads(path)
    assert found == [], "read these through fastxfer.settings.get (declared once):\n" + "\n".join(found)
