"""Every command of the error table in docs/cli.md prints its one-line message and exits
with its code, never a traceback."""

import shlex

import pytest

from kvjax import cli
from benchmarks.cli_errors import run, table_rows

ROWS = table_rows()


def test_the_table_lists_the_errors():
  assert len(ROWS) >= 20
  assert {row["exit"] for row in ROWS} == {2}


# Rows run from bash in a subprocess, as a user types them: shell quoting that Python's
# argv cannot carry (a non-UTF-8 byte), stdin closed, and one ordinary row; the others call
# `cli.main` in this process (a subprocess costs ~2 s of importing jax per row).
SHELL_ROWS = ("$'", "kvjax generate hi --frob")
# Rows of a size past the model context run in a shell with a limit of address space: the
# code before issue 45 sized the cache from them (gigabytes), and must fail there, not take
# the machine's memory. The refusal comes after the default model loads, well within 4 GiB.
BOUNDED_ROWS = "is larger than the model context"
ADDRESS_SPACE_KB = 4 * 2**20


def _in_shell(row) -> bool:
  return row["command"] == "kvjax generate" or any(m in row["command"] for m in SHELL_ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row["error"] for row in ROWS])
def test_each_error_of_the_table(row, capsys):
  if BOUNDED_ROWS in row["message"]:
    done = run(f"ulimit -v {ADDRESS_SPACE_KB}; {row['command']}")
    code, err = done.returncode, done.stderr.decode()
  elif _in_shell(row):
    done = run(row["command"])
    code, err = done.returncode, done.stderr.decode()
  else:
    try:
      code = cli.main(shlex.split(row["command"])[1:])
    except SystemExit as exit_:  # argparse's own errors
      code = exit_.code
    err = capsys.readouterr().err
  assert code == row["exit"], err
  assert "Traceback" not in err
  lines = [x for x in err.splitlines() if x.startswith("kvjax")]
  assert len(lines) == 1, err
  assert row["message"] in lines[0], lines[0]


def test_a_failed_run_is_one_line_and_exit_1(capsys, monkeypatch):
  def fail(args):
    raise RuntimeError("the device ran out of memory\nwhile decoding")

  parser = cli.build_parser()
  monkeypatch.setattr(cli, "build_parser", lambda: parser)
  parser._subparsers._group_actions[0].choices["generate"].set_defaults(func=fail)
  assert cli.main(["generate", "hi"]) == 1
  err = capsys.readouterr().err
  assert err == (
      "kvjax generate: failed: RuntimeError: the device ran out of memory while decoding "
      "(KVJAX_DEBUG=1 shows the traceback)\n"
  )
  monkeypatch.setenv("KVJAX_DEBUG", "1")
  with pytest.raises(RuntimeError):
    cli.main(["generate", "hi"])
