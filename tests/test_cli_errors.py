"""Every command of the error table in docs/cli.md prints its one-line message and exits
with its code, never a traceback."""

import pytest

from kvjax import cli
from kvjax.benchmarks.cli_errors import run, table_rows

ROWS = table_rows()


def test_the_table_lists_the_errors():
  assert len(ROWS) >= 20
  assert {row["exit"] for row in ROWS} == {2}


@pytest.mark.parametrize("row", ROWS, ids=[row["error"] for row in ROWS])
def test_each_error_of_the_table(row):
  done = run(row["command"])
  err = done.stderr.decode()
  assert done.returncode == row["exit"], err
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
