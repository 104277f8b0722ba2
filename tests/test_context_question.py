"""The question is never what compression drops: a context read and compressed, the question
read after it and protected for the rest of the request, by every policy; what was saved
said in the stats and the summary line; compression skipped, in one warning, where the
budget cannot save a page."""

import re
import warnings

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache.paged_cache import logical_view, valid_mask
from kvjax.cli import common
from kvjax.runtime import generation, prompts
from kvjax.runtime.prompts import chat_request
from kvjax.testing import ByteTokenizer, tiny_llama
from models import load_llama

SYSTEM = "You are a careful assistant. " * 6  # 174 bytes: a context worth compressing
QUESTION = "What is the capital of France?"
SCORING = ["h2o", "snapkv", "tova", "streaming", "kvzip", "expected_attention", "info_aware"]


class ChatBytes(ByteTokenizer):
  """Byte ids with a ChatML-like template whose default system prompt is long."""

  chat_template = "chatml-like"

  def apply_chat_template(self, messages, add_generation_prompt=True):
    if not messages or messages[0]["role"] != "system":
      messages = [{"role": "system", "content": SYSTEM}, *messages]
    text = "".join(f"<{m['role']}>\n{m['content']}</>\n" for m in messages)
    return text + ("<assistant>\n" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=1024, qk_scale=8.0), ChatBytes()


def _positions_held(state) -> np.ndarray:
  """[L, B, H, N] positions each sequence holds (-1 where a slot is empty)."""
  cache = state.cache
  return np.where(
      np.asarray(valid_mask(cache)), np.asarray(logical_view(cache, cache.slot("position"))), -1
  )


def _holds_every(state, positions: range, row: int = 0) -> bool:
  held = _positions_held(state)[:, row]  # [L, H, N]
  return all(
      np.isin(list(positions), held[layer, head]).all()
      for layer in range(held.shape[0])
      for head in range(held.shape[1])
  )


def test_a_chat_splits_at_its_last_user_message():
  tok = ChatBytes()
  context, question = chat_request(tok, [{"role": "user", "content": QUESTION}])
  assert tok.decode(context) == f"<system>\n{SYSTEM}</>\n"
  assert tok.decode(question) == f"<user>\n{QUESTION}</>\n<assistant>\n"
  turns = [
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello"},
      {"role": "user", "content": QUESTION},
  ]
  context, question = chat_request(tok, turns)
  assert tok.decode(context).endswith("<assistant>\nHello</>\n")
  assert tok.decode(question) == f"<user>\n{QUESTION}</>\n<assistant>\n"
  # A chat that ends with the assistant's message asks nothing: all of it is context.
  context, question = chat_request(tok, turns[:2])
  assert question == [] and tok.decode(context).endswith("<assistant>\n")


# Every scoring policy at both budgets in the slow set; a running, a compress-once and a
# recency policy by default (each case compiles its steps: ~10 s on 2 cores).
FAST = {("h2o", 16), ("kvzip", 0.25)}


@pytest.mark.parametrize(
    "policy,budget",
    [
        pytest.param(p, b, marks=() if (p, b) in FAST else pytest.mark.slow)
        for p in SCORING
        for b in (0.25, 16)
    ],
)
def test_the_question_survives_compression_and_decoding(tiny, policy, budget):
  model, tok = tiny
  spec = kvjax.CompressionSpec(policy=policy, budget=budget)
  request = prompts.encode_request(tok, [QUESTION], None, True, model.config.vocab_size)
  context = int(request.context.lengths[0])
  asked = range(context, int(request.lengths[0]))
  assert len(asked) == len(f"<user>\n{QUESTION}</>\n<assistant>\n")
  assert generation.skip_reason(spec, request, 24) is None
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the question alone may pass a 16-token budget
    state, _ = generation._read(model, tok, request, spec, 24, jax.random.key(0))
    assert _holds_every(state, asked), policy
    held = generation.held_stats(state, kvjax.ModelShape.of(model))
    assert held["kv_bytes_held"] < held["full_kv_bytes"]  # the context was compressed
    state, _ = kvjax.decode(model, state, 24, stop_tokens=())  # running policies evict here
  assert _holds_every(state, asked), policy


@pytest.mark.parametrize(
    "policy,budget",
    [
        pytest.param("h2o", 256, marks=pytest.mark.slow),
        ("kvzip", 0.25),
        pytest.param("full", None, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_generate_with_a_context_is_prefill_then_ask(tiny, policy, budget):
  model, tok = tiny
  spec = kvjax.CompressionSpec(policy=policy, budget=budget)
  document = "The pass key is 71432. " + "Grass is green and the sky is blue. " * 8
  result = kvjax.generate(
      model,
      tok,
      ["What is the pass key?"],
      spec,
      context=document,
      chat=True,
      max_new_tokens=12,
      stop_tokens=(),
  )
  state = kvjax.prefill(model, [document], spec, tokenizer=tok, chat=True, reserve=64)
  kept_peak = state.peak_kv_bytes()
  asked, answer = kvjax.ask(
      model, tok, state, ["What is the pass key?"], chat=True, max_new_tokens=12, stop_tokens=()
  )
  assert answer.tokens == result.tokens
  assert answer.texts == result.texts
  stats = result.stats
  # The bytes the stats report are the arrays': held once the question is read, and the
  # full cache's for the same tokens, read by the full cache itself.
  # The question as `ask` reads it: protected, after the context.
  question = [
      [kvjax.Segment(prompts.encode_question(tok, "What is the pass key?", True), protected=True)]
  ]
  asked_state = kvjax.extend(model, state, question)
  assert stats["kv_bytes_held"] == asked_state.kv_bytes()
  assert stats["context_peak_kv_bytes"] == kept_peak
  assert stats["peak_kv_bytes"] == asked.peak_kv_bytes()
  full = kvjax.prefill(model, [document], spec.full_cache(), tokenizer=tok, chat=True)
  full = kvjax.extend(model, full, question)
  assert stats["full_kv_bytes"] == full.kv_bytes()
  assert stats["context_tokens"][0] + stats["question_tokens"][0] == stats["prompt_tokens"][0]
  if policy == "full":
    assert stats["kv_bytes_held"] == stats["full_kv_bytes"]
  else:
    assert stats["kv_bytes_held"] < stats["full_kv_bytes"]


def test_a_budget_that_cannot_save_a_page_runs_the_full_cache_and_says_so(tiny):
  model, tok = tiny
  spec = kvjax.CompressionSpec(policy="kvzip", budget=400)
  with pytest.warns(kvjax.CompressionSkipped, match=r"cannot save a 16-token page"):
    result = kvjax.generate(model, tok, [QUESTION], spec, chat=True, max_new_tokens=4)
  stats = result.stats
  assert stats["kept_fraction"] == [1.0]
  assert stats["kv_bytes_held"] == stats["full_kv_bytes"]
  assert "kvzip" in stats["compression_skipped"] and stats["spec"]["policy"] == "kvzip"
  compressed = kvjax.generate(
      model, tok, [QUESTION], spec.replace(budget=0.25), chat=True, max_new_tokens=4
  )
  assert compressed.stats["compression_skipped"] is None


def test_raw_text_is_all_context_and_token_ids_need_no_tokenizer(tiny):
  model, tok = tiny
  request = prompts.encode_request(tok, ["abc " * 30], None, False, model.config.vocab_size)
  assert request.question is None
  ids = kvjax.generate(model, None, [[5, 6, 7] * 20], max_new_tokens=3, stop_tokens=())
  assert ids.texts is None and len(ids.tokens[0]) == 3
  with pytest.raises(TypeError, match="give stop_tokens="):
    kvjax.generate(model, None, [[5, 6, 7]], max_new_tokens=3)
  with pytest.raises(TypeError, match="pass tokenizer="):
    kvjax.generate(model, None, ["text"], max_new_tokens=3, stop_tokens=())


def test_the_summary_line_says_what_was_held_against_the_full_cache():
  stats = {
      "kv_bytes_held": int(16.7 * 2**20),
      "full_kv_bytes": int(64.7 * 2**20),
      "context_peak_kv_bytes": int(64.7 * 2**20),
      "peak_kv_bytes": int(20 * 2**20),
      "compressed_once": True,
  }
  assert common.kv_parts(stats) == ["KV held 16.7 of 64.7 MiB (26%)", "peak 64.7 MiB while scoring"]
  stats.update(context_peak_kv_bytes=0, compressed_once=False)
  assert common.kv_parts(stats) == [
      "KV held 16.7 of 64.7 MiB (26%)",
      "peak 20.0 MiB while decoding",
  ]
  stats.update(peak_kv_bytes=stats["kv_bytes_held"])
  assert common.kv_parts(stats) == ["KV held 16.7 of 64.7 MiB (26%)"]


# ---- the default model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
  return load_llama()


def _answers_paris(smollm, policy, budget):
  model, tok = smollm
  spec = kvjax.CompressionSpec(policy=policy, budget=budget)
  request = prompts.encode_request(tok, [QUESTION], None, True, model.config.vocab_size)
  asked = range(int(request.context.lengths[0]), int(request.lengths[0]))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state, _ = generation._read(model, tok, request, spec, 16, jax.random.key(0))
    assert _holds_every(state, asked), (policy, budget)
    state, out = kvjax.decode(model, state, 16, stop_tokens=tok.eos_ids)
  assert _holds_every(state, asked), (policy, budget)
  assert "Paris" in tok.decode(out.tokens[0], skip_special_tokens=True), (policy, budget)


def test_the_default_model_answers_paris_under_h2o_at_16_tokens(smollm):
  # Every scoring policy at a quarter and at 16 tokens: the slow table below.
  _answers_paris(smollm, "h2o", 16)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.25, 16])
@pytest.mark.parametrize("policy", [*SCORING, "learned"])
def test_every_scoring_policy_answers_paris(smollm, policy, budget, request):
  if (policy, budget) == ("learned", 16):
    # The question is kept whole, but 16 of the 21 system-prompt tokens the learned scorer
    # keeps lead the model to another answer ("L'Etoile, la Marseillaise, ..."): a quality
    # limit of that scorer at this budget, said here until it is lifted.
    request.node.add_marker(pytest.mark.xfail(strict=True, reason="learned at 16 tokens"))
  _answers_paris(smollm, policy, budget)


@pytest.mark.slow
def test_generate_context_on_a_passkey_document_equals_prefill_and_ask(smollm, tmp_path, capsys):
  """The CLI: `generate --context` against `prefill` + `ask` on a ~2,000-token real text
  with a pass key, and the summary line's bytes against the state's arrays."""
  from kvjax import cli
  from kvjax.eval import default_text

  model, tok = smollm
  text = default_text()
  document = text[:4500] + "\nThe pass key is 48213. Remember it.\n" + text[4500:9000]
  assert 1800 < len(tok.encode(document)) < 2300
  path = tmp_path / "doc.txt"
  path.write_text(document)
  flags = ["--policy", "kvzip", "--budget", "0.25", "--max-new-tokens", "12"]
  assert cli.main(["generate", "--context", str(path), "What is the pass key?", *flags]) == 0
  out = capsys.readouterr()
  # Whether kvzip at a quarter keeps this one key is a quality question, measured over 24+
  # cases by `kvjax eval passkey`; here the two paths must agree, whatever they answer.
  summary = out.err.strip().splitlines()[-1]
  held, full = map(float, re.search(r"KV held ([\d.]+) of ([\d.]+) MiB", summary).groups())
  state = kvjax.prefill(
      model, [document], kvjax.CompressionSpec("kvzip", 0.25), tokenizer=tok, chat=True
  )
  _, answer = kvjax.ask(model, tok, state, ["What is the pass key?"], chat=True, max_new_tokens=12)
  assert answer.texts[0] == out.out.strip()
  assert held == float(common.mib(answer.stats["kv_bytes_held"]))
  assert full == float(common.mib(answer.stats["full_kv_bytes"]))
  peak = float(re.search(r"peak ([\d.]+) MiB while scoring", summary).group(1))
  assert peak == float(common.mib(state.peak_kv_bytes()))
  saved = tmp_path / "state"
  assert cli.main(["prefill", "--context", str(path), "--save", str(saved), *flags[:4]]) == 0
  capsys.readouterr()
  assert cli.main(["ask", str(saved), "What is the pass key?", "--max-new-tokens", "12"]) == 0
  assert capsys.readouterr().out.strip() == out.out.strip()
