"""Every `fastxfer` subcommand's --help ends with an example that names the subcommand."""

import argparse

from fastxfer.cli import EXAMPLES, build_parser
from fastxfer.launch import main as launch


def _leaves(parser: argparse.ArgumentParser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, path + (name,))


def test_every_subcommand_help_ends_with_an_example_of_itself():
    leaves = dict(_leaves(build_parser(None)))
    assert {" ".join(p) for p in leaves} >= {"run", "topo", "doctor", "data pack", "data info", "bench compress",
                                             "bench allreduce", "bench pipeline", "bench placement", "bench train",
                                             "bench timeline", "bench elastic"}
    for path, parser in leaves.items():
        text = parser.format_help()
        name = " ".join(path)
        assert "\nexample:\n  " in text, f"fastxfer {name} --help has no example"
        example = text.split("\nexample:\n  ", 1)[1].strip()
        assert f"fastxfer {name} " in example, (name, example)
        if name in EXAMPLES:
            assert example == EXAMPLES[name]
    # `fastxfer run` parses with its own parser (and horovodrun through it): the same example
    assert "example:\n  horovodrun -np 2 --bind socket -- python train.py" in launch.parser("horovodrun").format_help()
