"""The ``fastxfer`` command."""

from __future__ import annotations

import argparse
import sys


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "compress":
        from fastxfer.bench import compress

        return compress.main(args)
    if args.bench == "placement":
        from fastxfer.bench import placement

        return placement.main(args)
    if args.bench == "allreduce":
        from fastxfer.bench import allreduce

        return allreduce.main(args)
    raise AssertionError(args.bench)  # argparse restricts the choices


def build_parser() -> argparse.ArgumentParser:
    import fastxfer

    p = argparse.ArgumentParser(prog="fastxfer", description="fast data-parallel training for TensorFlow / Keras 3")
    p.add_argument("--version", action="version", version=f"fastxfer {fastxfer.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    from fastxfer import run

    runp = sub.add_parser("run", help="start N workers with rank-prefixed output; one failing stops the rest",
                          description=run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_arguments(runp)
    runp.set_defaults(func=run.main)

    from fastxfer import topology

    topo = sub.add_parser("topo", help="machine topology and the worker placement plan",
                          description=topology.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    topology.add_arguments(topo)
    topo.set_defaults(func=topology.main)

    from fastxfer.data import cli as data_cli

    data = sub.add_parser("data", help="packed dataset format: pack, info")
    data_cli.add_arguments(data)
    data.set_defaults(func=data_cli.main)

    bench = sub.add_parser("bench", help="side-by-side benchmarks against the installed peers")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from fastxfer.bench import compress

    compress.add_arguments(bsub.add_parser(
        "compress", help="float32 <-> bf16/fp16 and fused packing vs ml_dtypes, numpy, tf.cast, torch",
        description=compress.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from fastxfer.bench import allreduce

    allreduce.add_arguments(bsub.add_parser(
        "allreduce", help="nccl-tests-style allreduce sweep vs torch gloo, mpi4py, Horovod; alpha-beta model",
        description=allreduce.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from fastxfer.bench import placement

    placement.add_arguments(bsub.add_parser(
        "placement", help="2-worker training-like step: unbound vs --bind numa vs engine pinned",
        description=placement.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    bench.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
