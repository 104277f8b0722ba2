"""Prompt, context, text and JSONL inputs are read within a size limit, refused when they
are not regular files, and fail with one line, never a MemoryError (issue 31, part 4)."""

import io
import os
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import pytest

from kvjax import cli
from kvjax.cli import common
from kvjax.eval import _data

CAP = 2**20  # KVJAX_MAX_TEXT_BYTES in these tests: 1 MiB


@pytest.fixture
def small_cap(monkeypatch):
  monkeypatch.setenv(_data.MAX_TEXT_ENV, str(CAP))


def _gzip(path, byte: bytes, size: int):
  """`path`: a gzip file of `size` copies of `byte`, written without holding them (a bomb:
  64 MiB of one byte packs into about 64 kB)."""
  packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: gzip framing
  chunk = byte * 2**20
  with open(path, "wb") as out:
    for _ in range(size // len(chunk)):
      out.write(packer.compress(chunk))
    out.write(packer.flush())
  return path


@pytest.fixture
def no_model(monkeypatch):
  """The commands here must fail before the model loads."""

  def load(name):
    raise AssertionError("the model was loaded")

  monkeypatch.setattr(common, "load_model", load)


def _one_line(err: str) -> str:
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("kvjax")]
  assert len(lines) == 1, err
  return lines[0]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_dev_zero_as_the_prompt_file_is_refused_at_once():
  # Should it be read, it fails at 4 GiB of address space rather than take the machine's memory.
  limited = (
      "import resource, runpy, sys\n"
      "try:\n"
      "  resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))\n"
      "except (ValueError, OSError):\n"
      "  pass\n"
      "sys.argv = ['kvjax', 'generate', '--prompt-file', '/dev/zero']\n"
      "runpy.run_module('kvjax.cli', run_name='__main__', alter_sys=True)\n"
  )
  start = time.perf_counter()
  run = subprocess.run([sys.executable, "-c", limited], capture_output=True, text=True, timeout=120)
  assert run.returncode == 2, run.stderr[-2000:]
  line = _one_line(run.stderr)
  assert "text file '/dev/zero' is a character device, not a regular file" in line
  assert "loading" not in run.stderr
  assert time.perf_counter() - start < 60  # the import of jax, not a read


def test_a_fifo_or_a_directory_is_refused(tmp_path, capsys, no_model):
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)

  def write():  # a writer, so that a reader that opens the FIFO gets "hello", not a hang
    try:
      fifo.write_text("hello")
    except BrokenPipeError:  # the reader below only opens it to release this writer
      pass

  writer = threading.Thread(target=write, daemon=True)
  writer.start()
  try:
    with pytest.raises(ValueError, match=r"'.*pipe' is a FIFO \(named pipe\), not a regular file"):
      _data.read_text(fifo)
    with pytest.raises(
        ValueError, match=r"JSONL file '.*pipe': a FIFO .named pipe., not a regular"
    ):
      _data.read_jsonl(fifo, ("text",))
  finally:
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # releases the writer
    writer.join(5)
  with pytest.raises(ValueError, match=r"text file '.*' is a directory, not a regular file"):
    _data.read_text(tmp_path)
  assert cli.main(["generate", "--prompt-file", str(tmp_path)]) == 2
  assert "is a directory, not a regular file" in _one_line(capsys.readouterr().err)


def test_a_gzip_bomb_stops_at_the_limit_holding_little_memory(tmp_path, small_cap):
  bomb = _gzip(tmp_path / "bomb.txt.gz", b"a", 64 * 2**20)
  assert bomb.stat().st_size < 2**20
  tracemalloc.start()
  try:
    with pytest.raises(ValueError) as err:
      _data.read_text(bomb)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  message = str(err.value)
  assert f"text file '{bomb}' is larger than 1 MiB once decompressed" in message
  assert _data.MAX_TEXT_ENV in message
  # The limit, a block read past it and the decompressor's buffers (about 3 MiB); not 64 MiB.
  assert peak < CAP + 4 * _data._BLOCK, peak


def test_a_binary_gzip_fails_on_its_first_block(tmp_path, small_cap):
  zeros = _gzip(tmp_path / "zeros.txt.gz", b"\x00", 64 * 2**20)
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=r"is binary \(NUL byte at offset 0\)"):
      _data.read_text(zeros)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < CAP + 4 * _data._BLOCK, peak


def test_the_cli_names_the_limit_and_the_file_before_loading(tmp_path, small_cap, capsys, no_model):
  bomb = _gzip(tmp_path / "bomb.txt.gz", b"a", 8 * 2**20)
  assert cli.main(["eval", "fidelity", "--text", str(bomb), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  line = _one_line(err)
  assert f"'{bomb}' is larger than 1 MiB once decompressed" in line
  assert "loading" not in err


def test_stdin_is_read_up_to_the_limit_only(small_cap, monkeypatch, capsys, no_model):
  class Endless(io.RawIOBase):  # `yes | kvjax generate -`: stdin that never ends
    given = 0

    def readable(self):
      return True

    def readinto(self, buffer):
      buffer[:] = b"y" * len(buffer)
      self.given += len(buffer)
      return len(buffer)

  stdin = Endless()
  with pytest.raises(ValueError, match="stdin is larger than 1 MiB"):
    _data.read_stream(io.BufferedReader(stdin), "stdin")
  assert stdin.given <= CAP + 2 * io.DEFAULT_BUFFER_SIZE
  piped = io.TextIOWrapper(io.BufferedReader(io.BytesIO(b"y\n" * CAP)))
  monkeypatch.setattr(sys, "stdin", piped)
  assert cli.main(["generate", "-"]) == 2
  err = capsys.readouterr().err
  assert "kvjax generate: error: stdin is larger than 1 MiB" in _one_line(err)
  assert "loading" not in err


def test_jsonl_files_have_the_same_limit(tmp_path, small_cap):
  big = tmp_path / "big.jsonl"
  with open(big, "w") as out:
    for i in range(CAP // 16):
      out.write(f'{{"text": "line {i:06d}"}}\n')  # 24 bytes a line: 1.5 MiB
  with pytest.raises(ValueError, match=r"cannot read JSONL file '.*big.jsonl': larger than 1 MiB"):
    _data.read_jsonl(big, ("text",))
  small = tmp_path / "small.jsonl"
  small.write_text('{"text": "caf\u00e9"}\r\n\n{"text": "two"}\n')
  assert _data.read_jsonl(small, ("text",)) == [{"text": "caf\u00e9"}, {"text": "two"}]


def test_a_bad_limit_is_refused(tmp_path, monkeypatch):
  (tmp_path / "a.txt").write_text("hello")
  monkeypatch.setenv(_data.MAX_TEXT_ENV, "lots")
  with pytest.raises(ValueError, match="KVJAX_MAX_TEXT_BYTES must be a number of bytes >= 1"):
    _data.read_text(tmp_path / "a.txt")
  monkeypatch.setenv(_data.MAX_TEXT_ENV, "5")
  assert _data.read_text(tmp_path / "a.txt") == "hello"  # exactly the limit is read
  (tmp_path / "a.txt").write_text("hello!")
  with pytest.raises(ValueError, match="larger than 5 bytes"):
    _data.read_text(tmp_path / "a.txt")


def test_a_tuned_spec_file_is_read_by_the_same_rules(tmp_path, small_cap, capsys):
  """--spec FILE: a device or a file past the limit is one line before the model loads."""
  import kvjax

  with pytest.raises(ValueError, match="not a tuned spec file .*character device"):
    kvjax.load_spec("/dev/zero")
  big = tmp_path / "tuned.json"
  big.write_text('{"format": "' + "x" * CAP + '"}')
  with pytest.raises(ValueError, match="larger than 1 MiB"):
    kvjax.load_spec(big)
  assert cli.main(["generate", "--spec", "/dev/zero", "Hi"]) == 2
  err = capsys.readouterr().err
  assert "character device" in _one_line(err) and "loading" not in err
