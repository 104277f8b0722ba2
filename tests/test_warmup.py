"""`kvjax warmup` fills the compiled-step store: a later process's first requests of the
warmed shapes load their steps instead of compiling them (issue 35, part 1)."""

import os
import subprocess
import sys

import pytest

from kvjax import cli
from kvjax.cli import common
from kvjax.runtime.warmup import default_lengths

# A process that runs `kvjax ...` (argv) on a tiny model, or one request when argv is
# "request", and prints its compile stats.
_SCRIPT = """
import json, sys
from kvjax import cli
from kvjax.cli import common
from kvjax.testing import ByteTokenizer, tiny_llama
model, tokenizer = tiny_llama(max_context=256), ByteTokenizer()
common.load_model = lambda name: (model, tokenizer)
if sys.argv[1] == "request":
    import kvjax
    kvjax.generate(model, tokenizer, [[7] * int(sys.argv[2])], max_new_tokens=4)
    print(json.dumps(kvjax.compile_stats()))
else:
    sys.exit(cli.main(sys.argv[1:]))
"""


def _run(env, *argv):
  return subprocess.run(
      [sys.executable, "-c", _SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=300
  )


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_warmed_store_serves_the_first_requests_of_a_new_process(tmp_path):
  import json

  env = {**os.environ, "KVJAX_CACHE_DIR": str(tmp_path / "cache")}
  env.pop("KVJAX_EXECUTABLES", None)  # the store on (the test suite turns it off)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  warm = _run(env, "warmup", "--lengths", "20", "40", "--max-new-tokens", "4")
  assert warm.returncode == 0, warm.stderr
  lines = warm.stdout.splitlines()
  assert lines[0].startswith(f"warming {tmp_path / 'cache' / 'executables'} for tiny")
  assert "20 tokens: 2 steps compiled, 0 loaded" in lines[1], lines
  assert "40 tokens: 1 steps compiled, 0 loaded" in lines[2], lines  # a new prefill chunk
  assert lines[-1].startswith("done in") and "3 steps compiled and stored" in lines[-1]
  # A new process: a 25-token prompt has the 20-token one's shapes (chunk 32, one bucket).
  request = _run(env, "request", "25")
  assert request.returncode == 0, request.stderr
  stats = json.loads(request.stdout.splitlines()[-1])
  assert stats["compiles"] == stats["loaded"] == 2, stats
  again = _run(env, "warmup", "--lengths", "20", "--max-new-tokens", "4")
  assert "0 steps compiled, 2 loaded from the store" in again.stdout, again.stdout


@pytest.mark.parametrize(
    "argv, env_change, message",
    [
        (["--lengths", "0"], {}, "--lengths must be >= 1, got 0"),
        (["--max-new-tokens", "0"], {}, "--max-new-tokens must be >= 1, got 0"),
        (["--lengths", "250"], {}, "--lengths 250 + --max-new-tokens 64 passes the model context"),
        ([], {"KVJAX_EXECUTABLES": "off"}, "KVJAX_EXECUTABLES=off turns the compiled-step store"),
        ([], {"KVJAX_CACHE_DIR": "off"}, "no compiled-step store: KVJAX_CACHE_DIR=off"),
    ],
)
def test_warmup_refuses_bad_input_before_any_work(
    monkeypatch, capsys, tmp_path, argv, env_change, message
):
  from kvjax.testing import ByteTokenizer, tiny_llama

  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("KVJAX_EXECUTABLES", raising=False)
  for name, value in env_change.items():
    monkeypatch.setenv(name, value)
  model = tiny_llama(max_context=256)
  monkeypatch.setattr(common, "load_model", lambda name: (model, ByteTokenizer()))
  monkeypatch.setattr(
      "kvjax.runtime.warmup.warmup", lambda *a, **k: pytest.fail("warmup ran"), raising=True
  )
  assert cli.main(["warmup", *argv]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and f"kvjax warmup: error: {message}" in err, err


def test_default_lengths_cover_every_bucket_and_short_prompt():
  assert default_lengths(8192, 64) == [32, 64, 128, 1984, 4032, 6080, 8128]
  assert default_lengths(2048, 64) == [32, 64, 128, 1984]
  assert default_lengths(100, 64) == [32, 36]


def test_the_python_api_refuses_bad_input_before_any_request(monkeypatch):
  import kvjax.runtime.generation
  from kvjax.testing import ByteTokenizer, tiny_llama
  from kvjax.runtime.warmup import warmup

  monkeypatch.setattr(kvjax.runtime.generation, "generate", lambda *a, **k: pytest.fail("ran"))
  model, tokenizer = tiny_llama(max_context=256), ByteTokenizer()
  for options, message in [
      ({"batch": 0}, "batch must be an int >= 1, got 0"),
      ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
      ({"max_new_tokens": 256}, "max_new_tokens=256 leaves no room for a prompt"),
      ({"lengths": [16, 0]}, "lengths must be an int >= 1, got 0"),
      ({"lengths": [250]}, r"lengths: a 250-token prompt \+ max_new_tokens=64 passes the model"),
  ]:
    with pytest.raises(ValueError, match=message):
      warmup(model, tokenizer, **options)
  with pytest.raises(ValueError, match="max_context must be an int >= 1"):
    default_lengths(0, 64)
