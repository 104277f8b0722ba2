"""Every size a cache gets is bounded by the model before anything is allocated; numbers
out of range are refused before the model loads; `kvjax ask` loads the model `kvjax
prefill` resolved, and only with the weights the state was saved with (issue 45,
findings 1, 5, 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import kvjax
from kvjax import cli
from kvjax.cli import common
from kvjax.seam import ModelShape
from kvjax.testing import ByteTokenizer, tiny_hf_checkpoint, tiny_llama

CONTEXT = 256  # the model context of the shapes and the tiny model here
SHAPE = ModelShape(
    n_layers=2, n_kv_heads=2, head_dim=8, vocab_size=259, max_context=CONTEXT, dtype="float32"
)
PROMPT = 8  # tokens: the short prompt
SEED_MAX = 2**32 - 1  # the seeds that give distinct keys (jax keeps 32 bits without x64)
TOP_K_MAX = 2**31 - 1  # top_k is an int32 of the compiled step


def _one_line(err: str) -> str:
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("kvjax")]
  assert len(lines) == 1, err
  return lines[0]


# ---- finding 1: sizes past the model context -------------------------------------------

# (spec fields, the field the message names): each one past the context of SHAPE.
PAST_THE_CONTEXT = [
    (dict(policy="h2o", budget=CONTEXT + 1), "budget=257"),
    (dict(policy="h2o", budget=10**8), "budget=100000000"),
    (dict(policy="kvzip", budget=10**7), "budget=10000000"),
    (dict(page_size=CONTEXT + 16), "page_size=272"),
    (dict(page_size=50_000_000), "page_size=50000000"),
    (dict(policy="h2o", budget=64, page_size=4 * CONTEXT), "page_size=1024"),
    (dict(sink=10**9), "sink=1000000000"),
    # A fraction rises to hold the protected tokens: at f96ad57, one token at a time (10^9
    # of them: ten minutes).
    (dict(policy="h2o", budget=0.5, recent=10**6), "recent=1000000"),
    (dict(prefill_chunk=10**9), "prefill_chunk=1000000000"),
    (dict(policy="kvzip:chunk=100000000", budget=0.5), "option chunk=100000000"),
    # kvzip's default pass (512) is longer than this context: up to it is allowed.
    (dict(policy="kvzip:chunk=600", budget=0.5), "option chunk=600"),
    (dict(policy="kvzip:lookback=100000000", budget=0.5), "option lookback=100000000"),
    (dict(policy="expected_attention:n_future=10000000", budget=0.5), "n_future=10000000"),
    (dict(policy="snapkv:kernel=1000000001", budget=64), "option kernel=1000000001"),
    (dict(policy="snapkv:window=100000000", budget=64), "option window=100000000"),
]


@pytest.mark.parametrize("fields, named", PAST_THE_CONTEXT, ids=[n for _, n in PAST_THE_CONTEXT])
def test_a_size_past_the_model_context_is_refused_before_the_plan(fields, named):
  spec = kvjax.CompressionSpec(**fields)  # valid without a model: the model bounds it
  message = f"{named} is larger than the model context of {CONTEXT} tokens"
  with pytest.raises(ValueError, match=message):
    spec.plan(SHAPE, batch=1, longest=PROMPT, reserve=64)
  with pytest.raises(ValueError, match=message):  # as the CLI checks it once the model loads
    spec.check_context(CONTEXT)


# The largest value of each size the model accepts: the plan's page tables and pool stay
# within a few model contexts per sequence, whatever the user gave.
LARGEST = [
    dict(policy="h2o", budget=CONTEXT),
    dict(policy="h2o", budget=CONTEXT, head_budget="layer"),
    dict(policy="h2o", budget=CONTEXT, sink=CONTEXT // 2, recent=CONTEXT // 2),
    dict(policy="h2o", budget=0.5, sink=CONTEXT, recent=CONTEXT),
    dict(policy="streaming", budget=3 * 64, page_size=64),
    dict(page_size=CONTEXT),
    dict(prefill_chunk=CONTEXT),
    dict(policy="kvzip", budget=CONTEXT),
    dict(policy=f"kvzip:chunk={CONTEXT}", budget=CONTEXT),
    dict(policy="kvzip", budget="auto", threshold=0.1, sink=CONTEXT, recent=CONTEXT),
    dict(policy=f"expected_attention:n_future={CONTEXT}", budget=CONTEXT),
]


@pytest.mark.parametrize("fields", LARGEST, ids=[str(f) for f in LARGEST])
@pytest.mark.parametrize("reserve", [0, 64, 10**12])
def test_the_plan_is_sized_from_the_model_at_the_largest_sizes_it_accepts(fields, reserve):
  spec = kvjax.CompressionSpec(**fields)
  batch = 2
  plan = spec.plan(SHAPE, batch=batch, longest=PROMPT, reserve=reserve)
  cfg = plan.config
  sequences = batch * SHAPE.n_layers * SHAPE.n_kv_heads
  pool_tokens = (cfg.pool_pages(sequences, plan.chunk) - 1) * cfg.page_size
  # The page table and the pool, per sequence: a few contexts at most (a context compressed
  # once holds the whole context and one reconstruction pass after it), never the user's
  # number; the chunk never passes the context either.
  assert cfg.max_tokens <= 3 * CONTEXT, cfg
  assert pool_tokens <= 3 * CONTEXT * sequences, (pool_tokens, cfg)
  assert plan.chunk <= CONTEXT


def test_a_prompt_past_the_context_is_refused_and_the_reserve_clipped_by_the_plan():
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.5)
  with pytest.raises(ValueError, match="prompt of 300 tokens is longer than the model context"):
    spec.plan(SHAPE, batch=1, longest=300, reserve=0)
  with pytest.raises(ValueError, match="reserve must be an int >= 0"):
    spec.plan(SHAPE, batch=1, longest=PROMPT, reserve=-1)
  clipped = spec.plan(SHAPE, batch=1, longest=PROMPT, reserve=10**12).config
  assert clipped == spec.plan(SHAPE, batch=1, longest=PROMPT, reserve=CONTEXT - PROMPT).config


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=CONTEXT), ByteTokenizer()


def test_generate_refuses_a_size_past_the_context_when_called_not_when_read(tiny):
  """A stream runs nothing until it is read: the sizes are checked before it is made (the
  CLI counts an error from the stream as a failed run, exit 1)."""
  model, tokenizer = tiny
  spec = kvjax.CompressionSpec(policy="h2o", budget=10**8)
  with pytest.raises(ValueError, match="budget=100000000 is larger than the model context of 256"):
    kvjax.generate(model, tokenizer, ["hello"], spec, max_new_tokens=4, stream=True)
  spec = kvjax.CompressionSpec(page_size=50_000_000)
  with pytest.raises(ValueError, match="page_size=50000000 is larger than the model context"):
    kvjax.generate(model, tokenizer, ["hello"], spec, max_new_tokens=4, stream=True)


# One process, under a limit of address space, runs every path a size reaches the cache by:
# the CLI's flags, a tuned spec file (--spec) and the Python API. At f96ad57 each allocated
# gigabytes (RESOURCE_EXHAUSTED, exit 1) or ran minutes: the script stops at the first case
# that is not refused, so the old code fails fast and cannot exhaust the machine.
_ALL_PATHS = textwrap.dedent("""
    import contextlib, io, json, resource, sys
    try:
      resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    except (ValueError, OSError):
      pass
    import kvjax, models
    from kvjax import cli
    from kvjax.fingerprint import model_fingerprint

    checkpoint, tuned = sys.argv[1], sys.argv[2]
    model, tokenizer = models.load_llama(checkpoint)
    record = {"format": "kvjax-tuned/1", "spec": {"policy": "h2o", "budget": 10**7},
              "model": "tiny", "fingerprint": model_fingerprint(model)}
    open(tuned, "w").write(json.dumps(record))
    run = ["generate", "--model", checkpoint, "--no-chat", "--quiet", "--max-new-tokens", "4"]
    cases = {
        "flag budget": run + ["--policy", "h2o", "--budget", "10000000", "abcabcab"],
        "flag page size": run + ["--page-size", "50000000", "abcabcab"],
        "flag kvzip budget": run + ["--policy", "kvzip", "--budget", "10000000", "abcabcab"],
        "spec file": run + ["--spec", tuned, "abcabcab"],
        "prefill flag": ["prefill", "--model", checkpoint, "--context", sys.argv[3], "--save",
                         sys.argv[4], "--no-chat", "--quiet", "--policy", "h2o", "--budget",
                         "10000000"],
    }
    for name, argv in cases.items():
      err = io.StringIO()
      with contextlib.redirect_stderr(err):
        code = cli.main(argv)
      print(json.dumps({"case": name, "code": code, "err": err.getvalue()}), flush=True)
      if code != 2:
        sys.exit(1)
    calls = {
        "api prefill": lambda: kvjax.prefill(
            model, ["abcabcab"], kvjax.CompressionSpec(policy="h2o", budget=10**7),
            tokenizer=tokenizer),
        "api generate": lambda: kvjax.generate(
            model, tokenizer, ["abcabcab"], kvjax.CompressionSpec(page_size=50_000_000)),
    }
    for name, call in calls.items():
      try:
        call()
        outcome = {"type": None, "err": ""}
      except Exception as e:
        outcome = {"type": type(e).__name__, "err": str(e)}
      print(json.dumps({"case": name, **outcome}), flush=True)
      if outcome["type"] != "ValueError":
        sys.exit(1)
    """)


def test_every_path_refuses_a_size_past_the_context_before_allocating(tmp_path):
  checkpoint = tiny_hf_checkpoint(tmp_path / "hf")
  context = tmp_path / "context.txt"
  context.write_text("abcabcab")
  argv = [str(checkpoint), str(tmp_path / "tuned.json"), str(context), str(tmp_path / "s")]
  run = subprocess.run(
      [sys.executable, "-c", _ALL_PATHS, *argv], capture_output=True, text=True, timeout=300
  )
  cases = {c["case"]: c for c in map(json.loads, run.stdout.splitlines())}
  assert run.returncode == 0, (cases, run.stderr[-3000:])
  limit = "is larger than the model context of 2048 tokens"  # the checkpoint's context
  for name in ("flag budget", "flag kvzip budget", "spec file", "prefill flag"):
    line = _one_line(cases[name]["err"])
    assert "budget=10000000 " + limit in line, line
    assert "loading" in cases[name]["err"]  # the model's context: known once it loaded
  assert "page_size=50000000 " + limit in _one_line(cases["flag page size"]["err"])
  assert "budget=10000000 " + limit in cases["api prefill"]["err"]
  assert "page_size=50000000 " + limit in cases["api generate"]["err"]
  assert not (tmp_path / "s").exists()  # nothing saved


# ---- finding 5: numbers out of range, before the model loads --------------------------


@pytest.fixture
def no_model(monkeypatch):
  def load(name):
    raise AssertionError("the model was loaded")

  monkeypatch.setattr(common, "load_model", load)


HUGE = "99999999999999999999"  # past 64 bits: an OverflowError in jax at f96ad57
SEED_RANGE = f"--seed must be an int in [0, {SEED_MAX}]"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "hi", "--top-k", "3000000000"],
            f"top_k must be an int >= 0 (0 = off) and <= {TOP_K_MAX}, got 3000000000",
        ),
        (["generate", "hi", "--seed", HUGE], f"{SEED_RANGE}, got {HUGE}"),
        (["generate", "hi", "--seed", "-1"], f"{SEED_RANGE}, got -1"),
        (["generate", "hi", "--temperature", "1e39"], "temperature must be a finite float32"),
        (["warmup", "--top-k", "3000000000"], "top_k must be an int >= 0 (0 = off) and <="),
        (["prefill", "--context", "c.txt", "--save", "s", "--seed", HUGE], SEED_RANGE),
        (["train-scorer", "--seed", str(SEED_MAX + 1)], f"{SEED_RANGE}, got {SEED_MAX + 1}"),
    ],
)
def test_numbers_out_of_range_are_refused_before_the_model_loads(argv, message, capsys, no_model):
  assert cli.main(argv) == 2
  line = _one_line(capsys.readouterr().err)
  assert message in line, line


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_the_api_refuses_a_seed_or_top_k_out_of_range(tiny):
  model, tokenizer = tiny
  with pytest.raises(ValueError, match=r"top_k must be an int >= 0 \(0 = off\) and <= 2147483647"):
    kvjax.Sampling(temperature=1.0, top_k=3_000_000_000)
  for seed in (99999999999999999999, 2**32, -1):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
      kvjax.generate(model, tokenizer, ["hi"], max_new_tokens=2, seed=seed, stream=True)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
      kvjax.prefill(model, ["hi"], tokenizer=tokenizer, seed=seed)
  # The largest seed and top_k in range run.
  sampling = kvjax.Sampling(temperature=1.0, top_k=TOP_K_MAX)
  result = kvjax.generate(
      model, tokenizer, ["hi"], max_new_tokens=2, seed=SEED_MAX, sampling=sampling
  )
  assert len(result.tokens[0]) <= 2


# ---- finding 8: the model `kvjax ask` loads ------------------------------------------


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_ask_loads_the_model_prefill_resolved_and_only_with_its_weights(
    tmp_path, monkeypatch, capsys
):
  """`prefill --model hf` (a relative path) records where it is; `ask` from another
  directory loads it; `--model` overrides, refused before the state is read unless it has
  the weights the state was saved with; a recorded model that is gone asks for --model."""
  work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
  elsewhere.mkdir()
  tiny_hf_checkpoint(work / "hf")
  tiny_hf_checkpoint(work / "other", seed=1)  # the same shapes, other weights
  (work / "context.txt").write_text("abcabcab")
  monkeypatch.chdir(work)
  argv = ["prefill", "--model", "hf", "--context", "context.txt", "--save", "state"]
  assert cli.main(argv + ["--no-chat", "--quiet"]) == 0
  info = kvjax.state_info(work / "state")
  hf = str((work / "hf").resolve())
  assert info["info"]["model"] == hf
  capsys.readouterr()
  monkeypatch.chdir(elsewhere)
  state = str(work / "state")
  assert cli.main(["ask", state, "abc", "--max-new-tokens", "2"]) == 0, capsys.readouterr().err
  err = capsys.readouterr().err
  assert f"loading {hf} ..." in err and "loaded the state of" in err
  assert cli.main(["ask", state, "abc", "--model", str(work / "other")]) == 2
  line = _one_line(capsys.readouterr().err)
  assert "was saved for model 'hf' with weights" in line and "has other weights" in line
  assert cli.main(["ask", state, "abc", "--max-new-tokens", "100000"]) == 2
  held = info["position"][0]
  assert f"--max-new-tokens 100000 after the state's {held} tokens passes the model context " in (
      _one_line(capsys.readouterr().err)
  )
  os.rename(work / "hf", work / "moved")
  assert cli.main(["ask", state, "abc"]) == 2
  line = _one_line(capsys.readouterr().err)
  assert f"was prefilled with model '{hf}', not found from here" in line
  assert "pass --model" in line
  moved = ["ask", state, "abc", "--model", str(work / "moved"), "--max-new-tokens", "2"]
  assert cli.main(moved) == 0
