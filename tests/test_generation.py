import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.runtime import compilation, sampling
from kvjax.testing import ByteTokenizer, counting_traces, tiny_llama
from models import load_llama


def _tiny_model(max_context=128):
  return tiny_llama(max_context=max_context)


@pytest.fixture(scope="module")
def smollm():
  return load_llama()


def test_paris_from_the_default_model(smollm):
  result = kvjax.generate(*smollm, ["What is the capital of France?"], chat=True, max_new_tokens=16)
  assert "Paris" in result.texts[0]
  assert result.finish_reasons == ["stop"]
  stats = result.stats
  assert stats["generated_tokens"][0] == len(result.tokens[0]) <= 16
  assert stats["peak_kv_bytes"] > 0 and stats["decode_tokens_per_s"] > 0


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_batched_ragged_prompts_match_each_prompt_alone(smollm):
  prompts = ["Name three colors.", "The Eiffel Tower is in", "1, 2, 3, 4,"]
  # A small chunk makes rows end their prompts in different prefill chunks.
  spec = kvjax.CompressionSpec(prefill_chunk=4, page_size=8)
  batched = kvjax.generate(*smollm, prompts, spec, max_new_tokens=10)
  for row, prompt in enumerate(prompts):
    alone = kvjax.generate(*smollm, [prompt], spec, max_new_tokens=10)
    assert alone.tokens[0] == batched.tokens[row], prompt


def test_decode_compiles_once_for_a_whole_generation():
  model, tokenizer = _tiny_model(), ByteTokenizer()
  compilation._KEPT.clear()
  spec = kvjax.CompressionSpec(prefill_chunk=4, page_size=4)
  with counting_traces() as traces:
    result = kvjax.generate(model, tokenizer, ["hello there"], spec, max_new_tokens=20)
    assert result.stats["generated_tokens"][0] + (result.finish_reasons[0] == "stop") >= 1
    # One trace for the whole decode loop (first: it compiles in the background while the
    # prompt is read), one for the prefill chunk shape.
    assert traces == [(1, 1), (1, 4)]
    assert result.stats["compiles"] == 2
    again = kvjax.generate(model, tokenizer, ["hello there"], spec, max_new_tokens=20)
    assert len(traces) == 2, "a second call with the same shapes must not retrace"
  assert again.stats["compiles"] == 0


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_sampling_values_compile_nothing_new_but_greedy_is_its_own_loop():
  """Temperature, top-k and top-p are traced; greedy (temperature 0) leaves the sampler out
  of the loop, so switching to sampling compiles one more loop, and no more after it."""
  model, tokenizer = _tiny_model(), ByteTokenizer()
  compilation._KEPT.clear()
  run = lambda **s: kvjax.generate(  # noqa: E731
      model, tokenizer, ["hello"], max_new_tokens=4, sampling=kvjax.Sampling(**s)
  )
  assert run().stats["compiles"] == 2  # the prefill chunk and the greedy loop
  assert run(temperature=0.7).stats["compiles"] == 1  # the sampling loop
  assert run(temperature=1.3, top_k=5, top_p=0.9).stats["compiles"] == 0
  assert run().stats["compiles"] == 0


def test_sampling_is_reproducible_and_respects_top_k():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
  key = jax.random.key(3)
  draws = sampling.sample(logits, key, 1.0, 2, 1.0)
  assert set(np.asarray(draws).tolist()) == {0, 1}
  np.testing.assert_array_equal(draws, sampling.sample(logits, key, 1.0, 2, 1.0))
  top_p = sampling.sample(logits, key, 1.0, 0, 0.7)  # 0.5 + 0.3 reach 0.7
  assert set(np.asarray(top_p).tolist()) == {0, 1}
  np.testing.assert_array_equal(sampling.sample(logits, key, 0.0, 0, 1.0), 0)
  full = np.bincount(np.asarray(sampling.sample(logits, key, 1.0, 0, 1.0)), minlength=4)
  assert full[3] > 0 and full[0] > full[1] > full[2]


def test_streaming_yields_the_same_tokens():
  model, tokenizer = _tiny_model(), ByteTokenizer()
  stream = kvjax.generate(model, tokenizer, ["abc", "hello"], max_new_tokens=6, stream=True)
  events = list(stream)
  whole = kvjax.generate(model, tokenizer, ["abc", "hello"], max_new_tokens=6)
  for row in range(2):
    assert [e.token for e in events if e.row == row] == whole.tokens[row]
  assert stream.result.tokens == whole.tokens


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        (["  "], {}, r"prompts\[0\] is empty"),
        ([[]], {}, r"prompts\[0\] is empty"),
        ("just a string", {}, "prompts must be a non-empty list"),
        ([], {}, "prompts must be a non-empty list"),
        (["x" * 200], {}, "prompt of 200 tokens is longer than the model context 128"),
        (["x" * 100], {"max_new_tokens": 40}, r"exceeds the model context 128"),
        (["abc"], {"spec": {"budget": 8}}, "budget=8 was given with policy 'full'"),
        (["abc"], {"spec": {"policy": "nope"}}, "unknown policy 'nope'"),
        (["abc"], {"spec": {"policy": "h2o"}}, "policy 'h2o' evicts to a budget"),
        (["abc"], {"spec": {"policy": "h2o", "budget": -5}}, "budget must be a positive int"),
        (["abc"], {"spec": {"page_size": 0}}, "page_size must be an int >= 1"),
        (["abc"], {"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        (["abc"], {"sampling": {"temperature": -1.0}}, "temperature must be a number >= 0"),
        (["abc"], {"sampling": {"top_p": 0.0}}, r"top_p must be in \(0, 1\]"),
        (["abc"], {"sampling": {"top_k": -1}}, "top_k must be an int >= 0"),
        ([[1, 999]], {}, r"token ids outside \[0, 259\)"),
    ],
)
def test_bad_input_raises_clear_errors(prompts, kwargs, match):
  with pytest.raises(ValueError, match=match):
    spec = kvjax.CompressionSpec(**kwargs.pop("spec", {}))
    sampling = kvjax.Sampling(**kwargs.pop("sampling", {}))
    kvjax.generate(_tiny_model(), ByteTokenizer(), prompts, spec, sampling=sampling, **kwargs)


def _cli(*args):
  return subprocess.run(
      [sys.executable, "-m", "kvjax.cli", *args], capture_output=True, text=True, timeout=300
  )


@pytest.mark.slow  # ~12 s: -m slow; the real CLI runs with --json in test_hardening
def test_cli_generate_json_answers_paris():
  run = _cli("generate", "What is the capital of France?", "--max-new-tokens", "16", "--json")
  assert run.returncode == 0, run.stderr
  out = json.loads(run.stdout)
  assert "Paris" in out["text"] and out["tokens"] and out["stats"]["prompt_tokens"] == [37]
  assert "loaded smollm2-135m-instruct" in run.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "model path not found"),
        (["generate", ""], "the prompt is empty"),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_cli_bad_input_exits_2_with_one_line(args, message):
  run = _cli(*args)
  assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "policy, budget", [("full", None), pytest.param("h2o", 24, marks=pytest.mark.slow)]
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_pallas_attention_generates_the_same_tokens_as_the_reference(policy, budget):
  """End to end: the Pallas decode kernel (interpret mode on CPU) through the model."""
  model, tokenizer = _tiny_model(), ByteTokenizer()
  prompts = ["the quick brown fox jumps", "hello world, hello paged attention"]
  spec = kvjax.CompressionSpec(policy=policy, budget=budget, prefill_chunk=8, page_size=8)
  ref = kvjax.generate(
      model, tokenizer, prompts, spec.replace(attention_impl="ref"), max_new_tokens=12
  )
  pallas = kvjax.generate(
      model, tokenizer, prompts, spec.replace(attention_impl="pallas"), max_new_tokens=12
  )
  assert all(len(t) == 12 for t in ref.tokens)  # no early stop: every decode step compared
  assert pallas.tokens == ref.tokens


@pytest.mark.parametrize("policy, budget", [("full", None), ("h2o", 24)])
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_request_compiles_its_steps_and_no_eager_ops(caplog, policy, budget):
  # Every eager op on the host's arrays compiles a small program the first time it sees a
  # shape (in a fresh process, ~20 ms each): a batch of 5 rows, used nowhere else, shows any.
  model, tokenizer = _tiny_model(), ByteTokenizer()
  spec = kvjax.CompressionSpec(policy, budget=budget, prefill_chunk=8, page_size=4)
  prompts = [f"row {i} " * (i + 6) for i in range(5)]
  with jax.log_compiles(), caplog.at_level("WARNING"):
    kvjax.generate(model, tokenizer, prompts, spec, max_new_tokens=6, seed=3)
  compiled = [r.getMessage().split()[1] for r in caplog.records if "Compiling " in r.getMessage()]
  assert "jit(_prefill_chunk)" in compiled and "jit(_decode)" in compiled  # new shapes
  # The steps, the empty cache, and the PRNG key made from the seed (a scalar).
  allowed = {"_prefill_chunk", "_decode", "_empty_arrays", "_threefry_seed", "stage"}
  assert set(compiled) <= {f"jit({name})" for name in allowed}, compiled
  staged = [r.getMessage() for r in caplog.records if "Compiling jit(stage)" in r.getMessage()]
  assert all("ShapedArray(int32[])," in m for m in staged), staged
