"""Every input a user can type gets a correct answer or a one-line error (issue: hardening)."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax import cli
from kvjax.eval import _data, _report, _sweep
from kvjax.runtime.generation import TextStream
from kvjax.testing import ByteTokenizer, tiny_llama
from models.registry import resolve_model
from models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_gguf(resolve_model().path)


def _kvjax(*args, stdin=None, env=None):
  """`kvjax ARGS` in a new process (argv as bytes where the test needs raw bytes)."""
  return subprocess.run(
      [sys.executable, "-m", "kvjax.cli", *args],
      input=stdin,
      capture_output=True,
      timeout=300,
      env={**os.environ, **(env or {})},
  )


def _one_error_line(run, code=2):
  err = run.stderr.decode()
  assert run.returncode == code, err
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("kvjax")]
  assert len(lines) == 1, err
  return lines[0]


# ---- 1. streaming text ---------------------------------------------------------------------

_MIXED = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),  # ASCII
        st.sampled_from("éèàçÉœßøñü"),  # accented Latin
        st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),  # CJK
        st.sampled_from("😀🎉🌍👍🏽🇫🇷"),  # emoji (with modifiers and flags)
        st.sampled_from("\u0301\u0308\u0327"),  # combining marks
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_MIXED, step=st.integers(1, 3))
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_streamed_pieces_concatenate_to_the_final_text(tokenizer, text, step):
  ids = tokenizer.encode(text)
  stream = TextStream(tokenizer)
  pieces = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)]
  pieces.append(stream.finish())
  final = tokenizer.decode(ids, skip_special_tokens=True)
  assert "".join(pieces) == final == text
  assert not any("\ufffd" in p for p in pieces)


def test_a_stream_cut_inside_a_character_ends_with_what_the_final_text_holds(tokenizer):
  ids = tokenizer.encode("日本")
  cut = ids[:-1]  # generation stopped inside the last character
  stream = TextStream(tokenizer)
  pieces = [stream.push([t]) for t in cut] + [stream.finish()]
  assert "".join(pieces) == tokenizer.decode(cut, skip_special_tokens=True)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_streaming_generate_matches_the_final_text_on_random_bytes():
  # A random byte-level model emits invalid UTF-8 too: the stream still equals the result.
  model, tok = tiny_llama(), ByteTokenizer()
  generation = kvjax.generate(model, tok, ["abc", "hé"], max_new_tokens=24, stream=True)
  events = list(generation)
  for row in range(2):
    streamed = "".join(e.text for e in events if e.row == row)
    assert streamed == generation.result.texts[row]


@pytest.mark.slow  # two real CLI runs; the streamed text's pieces are checked in-process above
def test_cli_streams_non_ascii_text_exactly_as_json_gives_it():
  prompt = "Écris une phrase en français avec des accents, puis 日本語 et un emoji 🎉."
  args = ("generate", prompt, "--max-new-tokens", "24")
  streamed = _kvjax(*args)
  as_json = _kvjax(*args, "--json")
  assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr
  text = json.loads(as_json.stdout)["text"]
  assert any(ord(c) > 127 for c in text)  # the answer is not plain ASCII
  assert streamed.stdout.decode() == text + "\n"


# ---- 2, 3, 10. prompts and text files --------------------------------------------------------


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_prompt_that_is_not_utf8_is_a_clear_error(tokenizer):
  model = tiny_llama()
  with pytest.raises(ValueError, match=r"prompts\[0\] is not valid UTF-8 text: character 3"):
    kvjax.generate(model, tokenizer, ["caf\udce9"], max_new_tokens=1)
  with pytest.raises(TypeError, match="text must be a str, got bytes"):
    tokenizer.encode(b"cafe")
  line = _one_error_line(_kvjax("generate", b"caf\xe9"))
  assert "the prompt is not valid UTF-8 text: character 3 is '\\udce9' (byte 0xe9)" in line


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x7fELF\x02\x01\x00\x00binary", "is binary .NUL byte at offset 6."),
        (b"caf\xe9 au lait", "is not UTF-8: byte 0xe9 at offset 3"),
        (b"  \n", "is empty"),
    ],
)
def test_text_files_must_be_utf8_text(tmp_path, content, message):
  path = tmp_path / "input.txt"
  path.write_bytes(content)
  with pytest.raises(ValueError, match=message):
    _data.read_text(path)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_eval_refuses_a_binary_text_file_before_loading_the_model(tmp_path):
  run = _kvjax("eval", "fidelity", "--text", "/bin/ls", "--out", str(tmp_path / "out"))
  line = _one_error_line(run)
  assert "'/bin/ls' is binary" in line and b"loading" not in run.stderr
  assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.slow  # heavy: run with -m slow
def test_prompt_from_stdin_and_from_a_file(tmp_path):
  question = "What is the capital of France?"
  (tmp_path / "prompt.txt").write_text(question)
  args = ("--max-new-tokens", "12", "--json")
  from_arg = json.loads(_kvjax("generate", question, *args).stdout)
  from_stdin = json.loads(_kvjax("generate", "-", *args, stdin=question.encode()).stdout)
  from_file = _kvjax("generate", "--prompt-file", str(tmp_path / "prompt.txt"), *args)
  assert from_arg["tokens"] == from_stdin["tokens"] == json.loads(from_file.stdout)["tokens"]
  assert "Paris" in from_arg["text"]
  line = _one_error_line(_kvjax("generate", "hi", "--prompt-file", str(tmp_path / "prompt.txt")))
  assert "(both were given)" in line


# ---- 4, 5. output directory and validation before loading ----------------------------------


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_bench_checks_its_output_directory_before_any_work():
  run = _kvjax("bench", "--quick", "--out", "/proc/nope")
  line = _one_error_line(run)
  assert "--out '/proc/nope' is not a writable directory" in line
  assert b"loading" not in run.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--policy", "h2o"], "policy 'h2o' evicts to a budget"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be a number >= 0"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "hi", "--model", "nope"], "unknown model 'nope'"),
        (["eval", "fidelity", "--policy", "h2o", "--budget", "-3"], "budget must be a positive"),
        (["eval", "fidelity", "--context-tokens", "0"], "--context-tokens must be >= 1"),
        (
            ["eval", "fidelity", "--policy", "h2o", "--budget", "4096", "--context-tokens", "512"],
            "is larger than the request of 512 tokens",
        ),
        (["eval", "fidelity", "--threshold", "-3"], "applies only with --budget auto"),
        (["bench", "--policy", "h2o", "--budget", "0.5", "--page-size", "0"], "page_size must be"),
        (["train-scorer", "--steps", "0"], "--steps must be >= 1"),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_argument_errors_come_before_the_model_loads(args, message):
  run = _kvjax(*args)
  assert message in _one_error_line(run)
  assert b"loading" not in run.stderr


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_sweep_saves_each_configuration_as_it_completes(tmp_path):
  model, tok = tiny_llama(max_context=512), ByteTokenizer()
  ids = list(np.random.default_rng(0).integers(3, 250, 2000))
  saved = []

  def on_row(results):
    _report.write(results, tmp_path, plot=False)
    saved.append(len(json.loads((tmp_path / "results.json").read_text())["rows"]))

  _sweep.run(
      "fidelity",
      model,
      tok,
      policies=["full", "h2o"],
      budgets=[0.5],
      context_tokens=[64],
      ids=ids,
      options={"windows": 1, "continuation_tokens": 8},
      progress=False,
      on_row=on_row,
  )
  assert saved == [1, 2]


# ---- 6, 7. arrays and values where a user would pass them ----------------------------------


def test_numpy_arrays_are_accepted_where_token_ids_and_tensors_go():
  model, tok = tiny_llama(), ByteTokenizer()
  from_list = kvjax.generate(model, tok, [[5, 6, 7]], max_new_tokens=3)
  from_numpy = kvjax.generate(model, tok, [np.array([5, 6, 7])], max_new_tokens=3)
  assert from_list.tokens == from_numpy.tokens
  cache = kvjax.init_cache(kvjax.CacheConfig(page_size=4, max_tokens=16), 1, 1, 1, 8, chunk=3)
  k = np.ones((1, 1, 3, 1, 8), np.float32)
  cache = kvjax.append(cache, k, k, np.arange(3, dtype=np.int32)[None])
  assert np.asarray(cache.length).tolist() == [[[3]]]


@pytest.mark.parametrize("text", [None, b"bytes", 3.5])
def test_a_segment_of_the_wrong_type_is_refused_at_once(text):
  with pytest.raises(TypeError, match="Segment: text must be a str or a sequence of token ids"):
    kvjax.Segment(text)


def test_errors_name_what_the_user_typed():
  with pytest.raises(ValueError, match="budget=200 was given with policy 'full'"):
    kvjax.CompressionSpec(budget=200)
  with pytest.raises(ValueError, match="budget must be a positive int .tokens. or a fraction"):
    kvjax.CompressionSpec(policy="h2o", budget=-5)
  with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
    kvjax.CompressionSpec(policy="h2o", budget=64, page_size=0)


# ---- 8. the out-of-pages hint names the chunk ----------------------------------------------


def test_out_of_pages_from_a_too_small_chunk_says_so():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=64, budget=8)
  k = np.ones((1, 1, 20, 1, 8), np.float32)
  positions = np.arange(20, dtype=np.int32)[None]
  small = kvjax.append(kvjax.init_cache(cfg, 1, 1, 1, 8, chunk=1), k, k, positions)
  with pytest.raises(
      kvjax.CacheError, match=r"sized for appends of chunk=1 .* init_cache\(chunk=\)"
  ):
    kvjax.check_status(small)
  kvjax.check_status(kvjax.append(kvjax.init_cache(cfg, 1, 1, 1, 8, chunk=20), k, k, positions))


# ---- 11. progress of long prefills ---------------------------------------------------------


def test_prefill_reports_its_progress_chunk_by_chunk():
  model, calls = tiny_llama(max_context=512), []
  spec = kvjax.CompressionSpec(prefill_chunk=64)
  kvjax.prefill(model, [list(range(3, 203))], spec, progress=lambda *a: calls.append(a))
  assert calls == [(64, 200), (128, 200), (192, 200), (200, 200)]
  with pytest.raises(TypeError, match="progress must be a callable"):
    kvjax.prefill(model, [[3, 4]], progress=5)


# ---- 12. tables and help -------------------------------------------------------------------


def _subparsers(parser, prefix=()):
  import argparse

  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        yield (*prefix, name), sub
        yield from _subparsers(sub, (*prefix, name))


def test_every_help_shows_the_defaults():
  import argparse

  for name, parser in _subparsers(cli.build_parser()):
    for action in parser._actions:
      if not action.option_strings or isinstance(action, argparse._HelpAction):
        continue
      if action.default is None or action.default is False:
        continue  # None: the help says what applies; False: a plain switch
      assert "default" in parser.formatter_class(prog="x")._get_help_string(action), (
          name,
          action.option_strings,
      )


def test_tables_call_crashed_cases_errors():
  results = {
      "task": "passkey",
      "rows": [
          {
              "policy": "h2o",
              "budget": 0.25,
              "budget_tokens": 256,
              "context_tokens": 1024,
              "cases": 1,
              "failed": 1,
              "errors": ["CacheError: out of pages"],
              "seconds": 1.0,
              "metrics": {"accuracy": 0.0, "correct": 0, "peak_kv_bytes": None},
          }
      ],
  }
  table = _report.markdown({**_report.new_results("passkey", tiny_llama(), {}), **results})
  assert "| errors |" in table and "failed" not in table
  assert "## Errors (cases that crashed; they count as wrong)" in table


# ---- 13. the pool never exceeds the full cache's -------------------------------------------


@pytest.mark.slow  # heavy: run with -m slow
def test_a_budget_above_short_prompts_holds_no_more_than_the_full_cache():
  model, tok = tiny_llama(max_context=512), ByteTokenizer()
  prompts = [f"question {i}: what is {i} + {i}?" for i in range(8)]
  protected = [[kvjax.Segment(p, protected=True)] for p in prompts]
  full = kvjax.generate(model, tok, prompts, max_new_tokens=8)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # protected tokens exceed the budget: kept, and said
    spec = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=8, sink=0, recent=0)
    small = kvjax.generate(model, tok, protected, spec, max_new_tokens=8)
    assert small.stats["pool_bytes"] <= full.stats["pool_bytes"]
    # A longer follow-up grows the pool to what the budget allows instead of failing.
    state = kvjax.prefill(model, protected, spec, tokenizer=tok, reserve=8)
    state = kvjax.extend(model, state, [list(range(3, 203))] * 8)
    state, result = kvjax.decode(model, state, 4)
  assert all(len(t) == 4 for t in result.tokens)
