"""Argument parsing for the ``tileops`` command, and the dispatch to its subcommands.

Each subcommand lives in its own module, which adds its parser (``register``) and handles it:
``demo``, ``ops`` (list_ops), ``backends`` (list_backends), ``explain``, ``check``, ``bench``
and ``overhead``. Those modules import torch, which takes seconds, so only the module of the
subcommand on the command line is imported: ``tileops --help`` and ``--version`` import none.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence

from .output import UsageError, version

#: subcommand -> (its module in this package, the line ``tileops --help`` lists for it)
COMMANDS = {
    "demo": ("demo", "run every op once and print what served each call"),
    "ops": ("list_ops", "list every op, its kernel implementations and the targets that serve it"),
    "backends": ("list_backends", "list installed backends, what each registered, and the ones that failed to load"),
    "explain": ("explain", "say which target and implementation would serve a call, and why"),
    "check": ("check", "validate the manifest and check every op class against its entry"),
    "bench": ("bench", "time the manifest workloads on this GPU against torch eager and torch.compile"),
    "overhead": ("overhead", "measure what the op layer adds per call (CPU, hit path)"),
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every other mistake's are (argparse
    prints its whole usage first); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists what it takes)\n")


class _Listed:
    """The subparsers action as a command module sees it: ``add_parser`` adds the summary the
    listing of ``tileops --help`` shows, from ``COMMANDS``."""

    def __init__(self, commands: argparse._SubParsersAction) -> None:
        self._commands = commands

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self._commands.add_parser(name, help=COMMANDS[name][1], **kwargs)


def build_parser(in_full: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The ``tileops`` parser, with the full parser of each command in ``in_full`` (importing
    its module); the other commands are listed only."""
    parser = _Parser(
        prog="tileops",
        description="TileOPs: PyTorch operators with TileLang kernels and pluggable backends.",
        epilog="Each command has --help. Exit status 2 means the command line was wrong.",
    )
    parser.add_argument("--version", action="version", version=f"tileops {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    in_full = set(in_full)
    for name, (module, summary) in COMMANDS.items():
        if name in in_full:
            importlib.import_module(f"{__package__}.{module}").register(_Listed(commands))
        else:
            commands.add_parser(name, help=summary)
    parser.set_defaults(subparsers=commands.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not an option (no top-level option takes a value).
    named = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser([named] if named in COMMANDS else [])
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if unknown:  # reported by the command's own parser, whose usage says what it takes; exits 2
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"tileops {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
