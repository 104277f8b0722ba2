"""The `kvjax` command line: `main` and the top-level parser. Each command family adds its
own subcommands: generate.py (generate, warmup), chat.py (chat), evaluate.py (eval, bench),
state.py (prefill, ask), tune.py (tune, train-scorer), doctor.py (doctor), serve.py (serve)."""

from __future__ import annotations

import argparse
import os
import sys

from kvjax._version import __version__
from kvjax.cli import chat, doctor, evaluate, generate, serve, state, tune
from kvjax.cli.common import EXIT_FAILED, EXIT_USAGE, Parser
from kvjax.cli.spec_flags import spec_from_args

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "build_parser", "main", "spec_from_args"]


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog="kvjax", description="KV-cache compression for JAX.")
  parser.add_argument("--version", action="version", version=f"kvjax {__version__}")
  commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
  # In the order `kvjax --help` lists them, which keeps train-scorer beside bench.
  generate.add_parsers(commands)
  chat.add_parsers(commands)
  evaluate.add_parsers(commands)
  tune.add_train_scorer_parser(commands)
  state.add_parsers(commands)
  tune.add_tune_parser(commands)
  doctor.add_parsers(commands)
  serve.add_parsers(commands)
  return parser


def main(argv=None) -> int:
  """Runs a command: exit 0; 2 with one line for a bad command line or input, a
  ValueError, TypeError or OSError raised before the command's work began
  (`common.begin_work`: nothing ran); 1 with one line for any error after it, when the run
  fails (KVJAX_DEBUG=1 shows the traceback)."""
  args = build_parser().parse_args(argv)
  args.work_began = False  # set by common.begin_work
  _one_line_warnings(args.command)
  try:
    return args.func(args)
  except KeyboardInterrupt:
    print(f"kvjax {args.command}: interrupted", file=sys.stderr)
    return 130
  except Exception as err:  # noqa: BLE001 - one line, never a traceback
    if os.environ.get("KVJAX_DEBUG"):
      raise
    message = " ".join(str(err).split()) or type(err).__name__
    if not args.work_began and isinstance(err, (ValueError, TypeError, OSError)):
      print(f"kvjax {args.command}: error: {message}", file=sys.stderr)
      return EXIT_USAGE
    print(
        f"kvjax {args.command}: failed: {type(err).__name__}: {message} "
        "(KVJAX_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _one_line_warnings(command: str) -> None:
  """Warnings (compression skipped, protected tokens over the budget) as one line each on
  stderr, each message once per run (a decode loop meets the same one at every call)."""
  import warnings

  warnings.simplefilter("once")
  warnings.formatwarning = lambda message, *_, **__: f"kvjax {command}: warning: {message}\n"


if __name__ == "__main__":
  sys.exit(main())
