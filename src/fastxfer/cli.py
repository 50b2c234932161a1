"""The ``fastxfer`` command."""

from __future__ import annotations

import argparse
import sys


BENCHMARKS = {
    "compress": "float32 <-> bf16/fp16 and fused packing vs ml_dtypes, numpy, tf.cast, torch",
    "allreduce": "nccl-tests-style allreduce sweep vs torch gloo, mpi4py, Horovod; alpha-beta model",
    "pipeline": "input pipeline images/s vs tf.data, PIL and decode alone",
    "placement": "2-worker training-like step: unbound vs pinned engine vs --bind numa",
    "train": "Keras ResNet-50 training, 1 vs 2 workers: fastxfer vs one process on every core, MWMS, Horovod",
    "timeline": "one training step of a timeline (FASTXFER_TIMELINE) as a picture and a summary",
    "elastic": "an elastic job with a worker killed: seconds until training resumes vs a new job",
}


# What `--help` of each subcommand ends with: one command line that works as it is.
EXAMPLES = {
    "run": "fastxfer run -np 2 --bind socket -- python train.py",
    "topo": "fastxfer topo --workers 2 --json",
    "doctor": "fastxfer doctor --np 2 --json",
    "data pack": "fastxfer data pack photos/ train.fxpack",
    "data info": "fastxfer data info train.fxpack --verify",
    "bench compress": "fastxfer bench compress --markdown --plot compress.png",
    "bench allreduce": "fastxfer bench allreduce -np 2 --peers fastxfer,mpi4py -b 4K -e 64M --markdown",
    "bench pipeline": "fastxfer bench pipeline --markdown",
    "bench placement": "fastxfer bench placement --markdown",
    "bench train": "fastxfer bench train --json train.json",
    "bench timeline": "FASTXFER_TIMELINE=t.json fastxfer run -np 2 python train.py; "
                      "fastxfer bench timeline t.json --plot step.png",
    "bench elastic": "fastxfer bench elastic --markdown",
}


def example(name: str) -> str:
    """The epilog of `name`'s --help."""
    return f"example:\n  {EXAMPLES[name]}"


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"fastxfer.bench.{args.bench}").main(args)


def _bench_named(argv: list[str]) -> str | None:
    """The benchmark a `fastxfer bench NAME ...` command line names, else None."""
    words = [a for a in argv if not a.startswith("-")]
    return words[1] if len(words) > 1 and words[0] == "bench" else None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line parser. A benchmark's own arguments are added only when ``argv`` runs
    that benchmark (every one's for ``argv=None``): importing them all cost every `fastxfer run` a
    second (ml_dtypes, through the compression benchmark)."""
    import fastxfer

    p = argparse.ArgumentParser(prog="fastxfer", description="fast data-parallel training for TensorFlow / Keras 3")
    p.add_argument("--version", action="version", version=f"fastxfer {fastxfer.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    from fastxfer.launch import main as launch

    runp = sub.add_parser("run", help="start N workers with rank-prefixed output; one failing stops the rest",
                          description=launch.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=example("run"))
    launch.add_arguments(runp)
    runp.set_defaults(func=launch.main)

    from fastxfer import topology

    topo = sub.add_parser("topo", help="machine topology and the worker placement plan",
                          description=topology.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=example("topo"))
    topology.add_arguments(topo)
    topo.set_defaults(func=topology.main)

    from fastxfer import doctor

    doc = sub.add_parser("doctor", help="what this installation got (kernels, JPEG, MPI, TensorFlow, /dev/shm, "
                                        "settings) and what is missing", description=doctor.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=example("doctor"))
    doctor.add_arguments(doc)
    doc.set_defaults(func=doctor.main)

    from fastxfer.data import cli as data_cli

    data = sub.add_parser("data", help="packed dataset format: pack, info")
    data_cli.add_arguments(data)
    data.set_defaults(func=data_cli.main)

    bench = sub.add_parser("bench", help="side-by-side benchmarks against the installed peers")
    bsub = bench.add_subparsers(dest="bench", required=True)
    import importlib

    named = None if argv is None else _bench_named(argv)
    for name, help_text in BENCHMARKS.items():
        if argv is not None and name != named:
            bsub.add_parser(name, help=help_text)  # listed in `fastxfer bench --help`; not what runs
            continue
        mod = importlib.import_module(f"fastxfer.bench.{name}")
        mod.add_arguments(bsub.add_parser(name, help=help_text, description=mod.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter,
                                          epilog=example(f"bench {name}")))
    bench.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None, prog: str = "fastxfer run") -> int:
    argv = sys.argv[1:] if argv is None else argv
    from fastxfer import settings

    try:  # every FASTXFER_* setting, before anything reads one: one line and exit code 2 for a bad value
        settings.validate_all()
    except settings.SettingError as e:
        print(f"fastxfer: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["run"]:  # its own parser: a bad flag shows `fastxfer run`'s usage, not the top level's
        from fastxfer.launch import horovod_flags
        from fastxfer.launch import main as launch

        args = launch.parser(prog).parse_args(horovod_flags.join_mpi_args(argv[1:]))
        return args.func(args)
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


def horovodrun(argv: list[str] | None = None) -> int:
    """The ``horovodrun`` command: ``fastxfer run`` under Horovod's name, so job scripts and schedulers'
    templates that call horovodrun run unchanged (docs/launchers.md)."""
    return main(["run", *(sys.argv[1:] if argv is None else argv)], prog="horovodrun")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
