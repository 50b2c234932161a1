"""``fastxfer doctor``: what this installation got, and what is missing for what you asked.

Reports the version, the SIMD kernel path in use and what the CPU offers, the ROI JPEG decoder and
the libjpeg it opens, MPI (mpi4py, the library and its thread support), TensorFlow and Keras and
whether fastxfer's op library loads into them, /dev/shm against what a job of ``--np`` ranks needs,
the topology in a line, and every setting that differs from its default. Exit code 0 when nothing
is wrong, 1 when something is (each with the fix), 2 for a setting with a bad value.

``--require tensorflow,native-ops,mpi,jpeg,bf16`` turns a missing part into a failure; a part you
asked for through a setting (FASTXFER_TF_NATIVE=1, FASTXFER_NATIVE_MPI=1 across hosts) counts as
required too, and a ``FASTXFER_*`` variable that is no setting (a typo) is always a failure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile

REQUIREMENTS = ("tensorflow", "native-ops", "mpi", "jpeg", "bf16")
_MPI_PROBE = (
    "import json, mpi4py\n"
    "mpi4py.rc.initialize = False\n"
    "from mpi4py import MPI\n"
    "v = MPI.Get_library_version().strip().splitlines()[0]\n"
    "MPI.Init_thread(MPI.THREAD_MULTIPLE)\n"
    "names = {MPI.THREAD_SINGLE: 'single', MPI.THREAD_FUNNELED: 'funneled', MPI.THREAD_SERIALIZED: 'serialized',"
    " MPI.THREAD_MULTIPLE: 'multiple'}\n"
    "print(json.dumps({'library': v, 'standard': '%d.%d' % MPI.Get_version(), 'thread_level': names.get("
    "MPI.Query_thread(), str(MPI.Query_thread())), 'file': MPI.__file__}))\n"
    "MPI.Finalize()\n"
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_core() -> dict:
    from fastxfer import _core, topology

    isa = topology.probe()["isa"]
    return {"version": _core.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "package": os.path.dirname(os.path.abspath(__file__)),
            "simd": {"active": _core.simd_level(), "supported": list(_core.supported_simd_levels()),
                     "cpu": [k for k, v in isa.items() if v]}}


def check_jpeg() -> dict:
    from fastxfer.data.decoders.native import libjpeg_path, native_decoder_status

    ok, why = native_decoder_status()
    return {"available": bool(ok), "detail": why, "libjpeg": libjpeg_path()}


def check_mpi() -> dict:
    out = {"mpi4py": _version("mpi4py"), "library": None, "thread_level": None}
    if out["mpi4py"] is None:
        out["detail"] = "mpi4py is not installed"
        return out
    env = {**os.environ, "OMPI_MCA_pml": os.environ.get("OMPI_MCA_pml", "ob1")}
    # Open MPI 5 started as a singleton (no mpirun: this probe) leaves its 16 MiB shared-memory
    # backing file in /dev/shm even after MPI_Finalize; each `fastxfer doctor` would cost a 64 MiB
    # container /dev/shm a quarter. The probe's file goes to a folder of its own, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="fastxfer-doctor-mpi-") as backing:
        env["OMPI_MCA_btl_sm_backing_directory"] = backing
        try:
            r = subprocess.run([sys.executable, "-c", _MPI_PROBE], capture_output=True, text=True, timeout=120,
                               env=env)
        except subprocess.TimeoutExpired:
            out["detail"] = "MPI did not start within 120 s (MPI_Init_thread hung)"
            return out
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        out["detail"] = f"mpi4py is installed but MPI does not start: {tail}"
        return out
    out.update(json.loads(lines[-1]))
    out["detail"] = "ok"
    return out


def check_tensorflow() -> dict:
    out = {"tensorflow": _version("tensorflow"), "keras": _version("keras"), "native_ops": False, "detail": ""}
    if importlib.util.find_spec("tensorflow") is None:
        out["detail"] = "TensorFlow is not installed"
        return out
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fastxfer.tensorflow import native

            lib = native.library()
    except Exception as e:  # TensorFlow itself fails to import: say so
        out["detail"] = f"importing TensorFlow failed: {type(e).__name__}: {e}"
        return out
    out["native_ops"] = lib is not None
    out["op_library"] = native.PATH
    out["detail"] = "the native ops load" if lib is not None else (native.reason() or "not loaded")
    return out


def check_shm(np_: int) -> dict:
    from fastxfer import _core, settings
    from fastxfer.comm import group, segments

    from fastxfer.errors import FastxferError

    try:
        folder = segments.shm_dir()
    except FastxferError as e:
        return {"dir": None, "ranks": np_, "need_bytes": 0, "size_bytes": None, "free_bytes": None,
                "detail": str(e)}
    window = int(settings.get("FASTXFER_SHM_WINDOW_MB") * (1 << 20))
    oob = int(settings.get("FASTXFER_OOB_KB") * 1024)
    need = int(_core.segment_bytes(np_, window, oob, group.MAX_RECORDS))
    out = {"dir": folder, "ranks": np_, "need_bytes": need, "size_bytes": None, "free_bytes": None}
    try:
        st = os.statvfs(folder)
        out["size_bytes"], out["free_bytes"] = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError as e:
        out["detail"] = f"cannot read {folder}: {e.strerror}"
    return out


def check_topology(np_: int) -> dict:
    from fastxfer import topology
    from fastxfer.errors import TopologyError

    notes = []
    try:
        p = topology.plan(np_)
    except TopologyError as e:  # more workers than cores, say: the machine still gets described
        p = topology.plan(None)
        notes.append(f"{np_} workers: {e}")
        p["mode"] = "cannot place"
    out = {k: p[k] for k in ("sockets", "cores", "threads_per_core", "mode", "precision_policy")}
    out["numa_nodes"] = len(p["numa_nodes"]) if isinstance(p["numa_nodes"], list) else p["numa_nodes"]
    out["notes"] = notes + list(p["notes"])
    return out


def changed_settings() -> list[dict]:
    """Every declared setting that is set to something other than its default (value as parsed)."""
    from fastxfer import settings

    out = []
    for s in settings.table():
        if not settings.is_set(s.name):
            continue
        value = settings.get(s.name)
        default = settings.get(s.default_from) if s.default_from else s.default
        if value != default:
            out.append({"name": s.name, "value": "<secret>" if s.secret else value,
                        "default": s.default_in_words(), "meaning": s.meaning})
    return out


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def problems(report: dict, required: set[str]) -> list[str]:
    """What is wrong, each with what to do."""
    from fastxfer import settings

    out = []
    tf, mpi, jpeg, shm = report["tensorflow"], report["mpi"], report["jpeg"], report["shm"]
    if "tensorflow" in required and not tf["tensorflow"]:
        out.append("TensorFlow is not installed: pip install 'fastxfer[tensorflow]'")
    wants_native = "native-ops" in required or (settings.is_set("FASTXFER_TF_NATIVE")
                                                and settings.get("FASTXFER_TF_NATIVE") is True)
    if wants_native and tf["tensorflow"] and not tf["native_ops"]:
        out.append(f"the native TensorFlow ops do not load ({tf['detail']}): reinstall fastxfer against this "
                   "TensorFlow (pip install --force-reinstall --no-deps fastxfer), or set FASTXFER_TF_NATIVE=0 "
                   "to use the slower tf.numpy_function bridge on purpose")
    if ("mpi" in required or (settings.is_set("FASTXFER_NATIVE_MPI") and settings.get("FASTXFER_NATIVE_MPI"))) \
            and not mpi.get("library"):
        out.append(f"MPI is not usable ({mpi['detail']}): pip install 'fastxfer[mpi]' (mpi4py and Open MPI), or "
                   "install mpi4py against the cluster's MPI (MPICC=mpicc pip install --no-binary mpi4py mpi4py)")
    if "jpeg" in required and not jpeg["available"]:
        out.append(f"the ROI JPEG decoder is not available ({jpeg['detail']}): install Pillow (pip install "
                   "'fastxfer[data]'; it ships the libjpeg-turbo fastxfer opens), or rebuild fastxfer with "
                   "libjpeg-turbo's headers installed if it was built with FASTXFER_JPEGLIB=OFF")
    if "bf16" in required and report["topology"]["precision_policy"] != "mixed_bfloat16":
        out.append("this CPU has neither AMX nor AVX-512 BF16: bf16 mixed precision runs through TensorFlow's "
                   "generic kernels, several times slower than float32; train in float32 here (bf16 gradients on "
                   "the wire, Compression.bf16, still pay off)")
    if shm.get("free_bytes") is not None and shm["free_bytes"] < shm["need_bytes"]:
        out.append(f"{shm['dir']} has {_mib(shm['free_bytes'])} free, and a job of {shm['ranks']} ranks needs "
                   f"{_mib(shm['need_bytes'])}: give the container more (docker run --shm-size=1g, or a larger "
                   f"tmpfs), lower FASTXFER_SHM_WINDOW_MB, or point FASTXFER_SHM_DIR at a larger tmpfs")
    elif "detail" in shm:
        out.append(f"{shm['detail']}: set FASTXFER_SHM_DIR to a writable tmpfs, or unset it for /dev/shm")
    for name in settings.undeclared():
        out.append(f"{name} is set but is no fastxfer setting (a typo, or another version's): fastxfer ignores it; "
                   "docs/configuration.md lists them all")
    return out


def collect(np_: int, required: set[str]) -> dict:
    report = {"fastxfer": check_core(), "jpeg": check_jpeg(), "mpi": check_mpi(), "tensorflow": check_tensorflow(),
              "shm": check_shm(np_), "topology": check_topology(np_), "settings": changed_settings()}
    report["required"] = sorted(required)
    report["problems"] = problems(report, required)
    report["ok"] = not report["problems"]
    return report


def text(report: dict) -> str:
    core, jpeg, mpi, tf, shm, topo = (report[k] for k in ("fastxfer", "jpeg", "mpi", "tensorflow", "shm", "topology"))
    lines = [f"fastxfer {core['version']} (Python {core['python']}, {core['platform']})",
             f"  installed at  {core['package']}",
             f"  kernels       {core['simd']['active']} (this CPU runs: {', '.join(core['simd']['supported'])}; "
             f"offers {', '.join(core['simd']['cpu']) or 'none of avx2/f16c/avx512/amx'})",
             "  JPEG decoder  " + (f"ROI decoder, {jpeg['libjpeg']}" if jpeg["available"]
                                   else f"off: {jpeg['detail']}"),
             "  MPI           " + (f"{mpi['library']} (MPI {mpi['standard']}, threads: {mpi['thread_level']}; "
                                    f"mpi4py {mpi['mpi4py']})" if mpi.get("library") else mpi["detail"]),
             "  TensorFlow    " + (f"{tf['tensorflow']}, Keras {tf['keras']}: {tf['detail']}" if tf["tensorflow"]
                                    else tf["detail"])]
    if shm.get("free_bytes") is not None:
        lines.append(f"  /dev/shm      {shm['dir']}: {_mib(shm['free_bytes'])} free of {_mib(shm['size_bytes'])}; "
                     f"a job of {shm['ranks']} ranks needs {_mib(shm['need_bytes'])}")
    lines.append(f"  topology      {topo['sockets']} socket(s), {topo['cores']} core(s) x {topo['threads_per_core']} "
                 f"thread(s), {topo['numa_nodes']} NUMA node(s); {shm['ranks']} workers: {topo['mode']}; "
                 f"precision: {topo['precision_policy']}")
    if report["settings"]:
        lines.append("  settings that differ from their defaults:")
        lines += [f"    {s['name']}={s['value']} (default {s['default']}): {s['meaning']}" for s in report["settings"]]
    else:
        lines.append("  settings      all at their defaults")
    if report["problems"]:
        lines.append(f"{len(report['problems'])} problem(s):")
        lines += [f"  - {p}" for p in report["problems"]]
    else:
        lines.append("no problems found" + (f" (required: {', '.join(report['required'])})" if report["required"]
                                            else ""))
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--np", type=int, default=2, help="ranks per host to check /dev/shm for (default 2)")
    p.add_argument("--require", default="", help=f"comma-separated, of {', '.join(REQUIREMENTS)}: missing ones "
                                                 "are failures (exit code 1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args) -> int:
    required = {r.strip() for r in args.require.split(",") if r.strip()}
    unknown = required - set(REQUIREMENTS)
    if unknown:
        print(f"fastxfer doctor: --require {', '.join(sorted(unknown))}: expected some of {', '.join(REQUIREMENTS)}",
              file=sys.stderr)
        return 2
    if args.np < 1:
        print("fastxfer doctor: --np must be at least 1", file=sys.stderr)
        return 2
    report = collect(args.np, required)
    print(json.dumps(report, indent=2, default=str) if args.json else text(report))
    return 0 if report["ok"] else 1
