"""docs/quickstart.md is true when run: it is the site's first page, every `kvjax` command on
it parses, every Python block compiles, and (slow) every command and block runs, in order,
in a fresh folder, the server started as the page starts it."""

import pathlib
import re
import shlex
import signal
import subprocess
import sys

import pytest
import yaml

from kvjax.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"


def _blocks(kind: str) -> list[str]:
  return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def _command_lines() -> list[str]:
  return [line.strip() for block in _blocks("bash") for line in block.splitlines() if line.strip()]


def test_the_quickstart_is_the_first_page_after_home():
  nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
  assert nav[1] == {"Quickstart": "quickstart.md"}, nav[:2]


def test_every_kvjax_command_parses_and_every_python_block_compiles():
  commands = [line for line in _command_lines() if line.startswith("kvjax ")]
  assert len(commands) >= 5, commands
  for line in commands:
    argv = shlex.split(line.removesuffix("&").strip())[1:]
    build_parser().parse_args(argv)  # a usage error exits 2 here
  blocks = _blocks("python")
  assert len(blocks) >= 3
  for block in blocks:
    compile(block, str(PAGE), "exec")


def _run(command: str, cwd: pathlib.Path, timeout: float = 900) -> subprocess.CompletedProcess:
  done = subprocess.run(
      command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=timeout
  )
  assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
  return done


@pytest.mark.slow
def test_every_command_and_block_runs(tmp_path):
  from kvjax.testing import start_server

  server = None
  outputs = []
  try:
    bash, python = _blocks("bash"), _blocks("python")
    for line in _command_lines():
      if line.startswith("pip install"):
        continue  # the test runs in the installed project
      if line.startswith("kvjax serve") and line.endswith("&"):
        flags = shlex.split(line.removesuffix("&"))[2:]
        server, url = start_server(flags, tmp_path / "serve.log")
        continue
      outputs.append(_run(line, tmp_path))
    assert server is not None, "the page starts a server"
    for block in python:
      if server is not None:
        block = block.replace("http://127.0.0.1:8000", url)
      script = tmp_path / "block.py"
      script.write_text(block)
      outputs.append(_run(f"{shlex.quote(sys.executable)} block.py", tmp_path))
    assert len(outputs) == len(
        [x for x in _command_lines() if not x.startswith(("pip", "kvjax serve"))]
    ) + len(python)
    text = "\n".join(o.stdout + o.stderr for o in outputs)
    assert "Paris" in text
    assert re.search(r"KV held [\d.]+ of [\d.]+ MiB \(2\d%\)", text)  # kvzip at 0.25
    assert "slang" in text  # the answers are about the document
    assert bash  # (the page's commands ran above)
  finally:
    if server is not None:
      server.send_signal(signal.SIGTERM)
      server.wait(timeout=120)
