import json
import re
import types

import numpy as np
import pytest

import kvjax
from kvjax import eval as E
from kvjax.eviction.allocation import HeadAllocation
from kvjax.eval import _answers, _data, _report, _sweep, _tasks
from kvjax.fingerprint import model_fingerprint
from kvjax.testing import tiny_llama
from models import resolve_model
from models.tokenizer import Tokenizer


def _failing_second_call(real):
  """`real`, except that its second call raises RuntimeError('boom') (a crashed case)."""
  calls = []

  def flaky(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("boom")
    return real(*args, **kwargs)

  return flaky


SHORT_FIDELITY = {"continuation_tokens": 4, "windows": 1}


@pytest.fixture
def sweep(model, tokenizer, text_ids):
  """`E.run_sweep(task, policies, budgets, context_tokens, ...)` on the shared model and text,
  without a progress bar."""

  def run(task, policies, budgets, context_tokens, **kwargs):
    lists = dict(policies=policies, budgets=budgets, context_tokens=context_tokens)
    return E.run_sweep(task, model, tokenizer, ids=text_ids, progress=False, **lists, **kwargs)

  return run


def _tiny_model():
  return tiny_llama(vocab_size=64, max_context=256)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_full_cache_fidelity_is_exact_and_compression_is_measured():
  model = _tiny_model()
  rng = np.random.default_rng(0)
  context, continuation = rng.integers(0, 64, 96).tolist(), rng.integers(0, 64, 12).tolist()
  full = E.fidelity(model, context, continuation, kvjax.CompressionSpec())
  assert full["kl"] == 0.0 and full["top1"] == 1.0 and full["ppl"] == full["ppl_full"]
  spec = kvjax.CompressionSpec(policy="h2o", budget=16, prefill_chunk=16, page_size=4)
  squeezed = E.fidelity(model, context, continuation, spec)
  assert squeezed["kl"] > 0.0 and squeezed["peak_kv_bytes"] < full["peak_kv_bytes"]


def test_compare_predictions_matches_hand_computed_values():
  ref = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
  got = np.log(np.array([[0.25, 0.75], [0.9, 0.1]]))
  r = E.compare_predictions(ref, got, np.array([0, 0]))
  kl = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
  assert r["kl"] == pytest.approx(kl / 2, rel=1e-5)
  assert r["top1"] == 0.5  # argmax of [0.5, 0.5] is 0, of [0.25, 0.75] is 1
  assert r["ppl_full"] == pytest.approx(np.exp(-(np.log(0.5) + np.log(0.9)) / 2), rel=1e-5)
  assert r["ppl"] == pytest.approx(np.exp(-(np.log(0.25) + np.log(0.9)) / 2), rel=1e-5)


def test_fidelity_rejects_empty_text():
  with pytest.raises(ValueError, match="non-empty context and continuation, got 0 and 3"):
    E.fidelity(_tiny_model(), [], [1, 2, 3], kvjax.CompressionSpec())


# --- tasks, sweeps and reports (tiny random model with the default model's tokenizer) ---


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_gguf(resolve_model().path)


@pytest.fixture(scope="module")
def model(tokenizer):
  return tiny_llama(vocab_size=tokenizer.vocab_size, max_context=2048)


@pytest.fixture(scope="module")
def text_ids(tokenizer):
  return tokenizer.encode(E.default_text()[:20000])


def test_case_windows_are_disjoint_where_the_text_holds_them_else_spread_evenly():
  ids = list(range(100))
  assert [w[0] for w in _data.windows(ids, 20, 5)] == [0, 20, 40, 60, 80]
  assert [w[0] for w in _data.windows(ids, 40, 5)] == [0, 15, 30, 45, 60]  # overlapping
  assert all(len(w) == 40 for w in _data.windows(ids, 40, 5))
  with pytest.raises(ValueError, match="has 100 tokens, too short for a window of 101 tokens"):
    _data.windows(ids, 101, 1)


def test_default_text_ships_with_the_package():
  text = E.default_text()
  assert len(text) > 500_000 and "hacker" in text


def test_passkey_case_is_exactly_the_requested_length_and_holds_the_key(tokenizer):
  for depth in (0.0, 0.5, 1.0):
    ids = _tasks.passkey_case(tokenizer, 300, depth, "48213")
    opening, _ = _answers.chat_parts(tokenizer, True)
    question = _answers.encode_question(tokenizer, _data.PASSKEY_QUESTION, True)
    assert len(opening) + len(ids) + len(question) == 300
    assert "The pass key is 48213." in tokenizer.decode(ids)
  with pytest.raises(ValueError, match="context_tokens=60 is too short"):
    _tasks.passkey_case(tokenizer, 60, 0.5, "48213")


def test_passkey_counts_every_case_and_reports_answers(model, tokenizer):
  r = E.passkey(model, tokenizer, context_tokens=200, depths=(0.2, 0.8), trials=2, max_new_tokens=4)
  assert r["cases"] == 4 and r["failed"] == 0 and len(r["answers"]) == 4
  assert r["accuracy"] == r["correct"] / 4
  assert {a["depth"] for a in r["answers"]} == {0.2, 0.8}
  assert all(a["expected"].isdigit() and len(a["expected"]) == 5 for a in r["answers"])


def test_passkey_fillers_give_fillers_x_depths_x_trials_cases(model, tokenizer, text_ids):
  cases = _tasks.passkey_cases(
      tokenizer, 300, depths=(0.2, 0.8), trials=2, fillers=("repeat", "text"), ids=text_ids
  )
  assert [(c["filler"], c["depth"]) for c in cases] == [
      (f, d) for f in ("repeat", "text") for d in (0.2, 0.8) for _ in range(2)
  ]
  opening, _ = _answers.chat_parts(tokenizer, True)
  question = _answers.encode_question(tokenizer, _data.PASSKEY_QUESTION, True)
  for case in cases:
    text = tokenizer.decode(case["ids"])
    assert len(opening) + len(case["ids"]) + len(question) == 300
    assert f"The pass key is {case['answer']}." in text
    assert ("The grass is green." in text) == (case["filler"] == "repeat")
  # Each "text" case has its own window of the text.
  windows = {tokenizer.decode(c["ids"][-40:]) for c in cases if c["filler"] == "text"}
  assert len(windows) == 4
  # The default filler keeps the keys passkey drew before fillers existed.
  rng = np.random.default_rng(0)
  old_keys = [str(rng.integers(10000, 100000)) for _ in range(4)]
  repeat = _tasks.passkey_cases(tokenizer, 300, depths=(0.2, 0.8), trials=2)
  assert [c["answer"] for c in repeat] == old_keys == [c["answer"] for c in cases[:4]]
  r = E.passkey(
      model,
      tokenizer,
      context_tokens=200,
      depths=(0.5,),
      fillers=("repeat", "text"),
      ids=text_ids,
      max_new_tokens=2,
  )
  assert r["cases"] == 2 and r["failed"] == 0
  assert [a["filler"] for a in r["answers"]] == ["repeat", "text"]
  for fillers in (("nope",), (), "text"):
    with pytest.raises(
        ValueError, match=r"fillers must be a non-empty list of repeat, text, needles"
    ):
      E.passkey(model, tokenizer, context_tokens=200, fillers=fillers, ids=text_ids)


def test_needles_hide_a_key_per_door_in_real_text_and_ask_for_one(tokenizer, text_ids):
  cases = _tasks.passkey_cases(
      tokenizer, 300, depths=(0.1, 0.5, 0.9), trials=2, fillers=("text", "needles"), ids=text_ids
  )
  text_cases, needle_cases = cases[:6], cases[6:]
  # The "text" cases keep the keys and windows they have without the needles.
  alone = _tasks.passkey_cases(
      tokenizer, 300, depths=(0.1, 0.5, 0.9), trials=2, fillers=("text",), ids=text_ids
  )
  assert [c["answer"] for c in alone] == [c["answer"] for c in text_cases]
  opening, _ = _answers.chat_parts(tokenizer, True)
  for case in needle_cases:
    text = tokenizer.decode(case["ids"])
    keys = re.findall(r"The pass key of the (\w+) door is (\d{5})\.", text)
    assert sorted(door for door, _ in keys) == sorted(_data.DOORS)  # three doors, once each
    assert dict(keys)[case["door"]] == case["answer"]
    assert len({key for _, key in keys}) == 3
    assert case["question"] == _data.DOOR_QUESTION.format(door=case["door"])
    question = _answers.encode_question(tokenizer, case["question"], True)
    assert len(opening) + len(case["ids"]) + len(question) == 300
    # The asked key sits at its depth of the text (the others spread around it).
    body = text[len(_data.PASSKEY_INTRO) :]
    at = body.index(f"the {case['door']} door is")
    assert abs(at / len(body) - case["depth"]) < 0.2  # the other two keys shift it a little
  assert len({c["door"] for c in needle_cases}) > 1  # the door asked varies


def test_multi_question_case_puts_each_fact_at_its_depth(tokenizer, text_ids):
  facts = [("red door", "48213"), ("blue box", "10001"), ("green key", "20002")]
  facts += [("yellow car", "30003"), ("silver safe", "40004")]
  case = _tasks.multi_question_case(tokenizer, text_ids[1000:], 600, facts)
  ids = case["ids"]
  questions = [f["question_ids"] for f in case["facts"]]
  assert _answers.request_tokens(tokenizer, ids, questions, True) == 600
  assert [f["depth"] for f in case["facts"]] == [0.1, 0.3, 0.5, 0.7, 0.9]
  for (subject, key), fact in zip(facts, case["facts"]):
    sentence = tokenizer.encode(f" The code of the {subject} is {key}.")
    assert ids[fact["at"] : fact["at"] + len(sentence)] == sentence
    assert abs(fact["at"] / len(ids) - fact["depth"]) < 0.05
    assert fact["answer"] == key
    question = tokenizer.decode(fact["question_ids"])
    assert f"What is the code of the {subject}? Answer with the number only." in question
  with pytest.raises(ValueError, match="context_tokens=80 is too short for 5 facts"):
    _tasks.multi_question_case(tokenizer, text_ids, 80, facts)


def test_multi_question_prefills_once_and_answers_every_question_from_that_state(
    model, tokenizer, text_ids, monkeypatch
):
  prefilled, asked = [], []
  real_prefill = _answers.prefill

  def prefill(*args, **kwargs):
    prefilled.append(real_prefill(*args, **kwargs))
    return prefilled[-1]

  def ask(model, tokenizer, state, questions, *, max_new_tokens, donate=False, **kwargs):
    # A stub model: right about the facts in the first half of the context only.
    [question] = questions
    asked.append((state, donate, tokenizer.decode(list(question))))
    subject = re.search(r"code of the (.+?)\?", asked[-1][2]).group(1)
    fact = next(f for c in cases for f in c["facts"] if f["subject"] == subject)
    reply = f"It is {fact['answer']}." if fact["depth"] < 0.5 else "I do not know, 12345."
    return state, types.SimpleNamespace(texts=[reply], tokens=[tokenizer.encode(reply)])

  monkeypatch.setattr(_answers, "prefill", prefill)
  monkeypatch.setattr(_answers, "kvjax_ask", ask)
  # One trial, so that every subject names one fact.
  cases = _tasks.multi_question_cases(tokenizer, text_ids, 300, facts=4, trials=1)
  r = E.multi_question(model, tokenizer, text_ids, context_tokens=300, facts=4, trials=1)
  assert len(prefilled) == 1 and len(asked) == 4
  assert all(state is prefilled[0] and not donate for state, donate, _ in asked)
  assert r["questions"] == 4 and r["cases"] == 1 and r["failed"] == 0
  assert [a["depth"] for a in r["answers"]] == [0.1, 0.367, 0.633, 0.9]
  assert r["correct"] == 2 and r["accuracy"] == 0.5  # the two facts before the middle
  assert [a["expected"] for a in r["answers"]] == [f["answer"] for f in cases[0]["facts"]]
  assert r["answers"][0]["answer"] == f"It is {cases[0]['facts'][0]['answer']}."


@pytest.mark.slow  # heavy: run with -m slow
def test_multi_question_counts_every_question_and_a_crashed_context(
    model, tokenizer, text_ids, monkeypatch
):
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.5)
  kwargs = dict(context_tokens=200, spec=spec, facts=4, trials=2, max_new_tokens=3)
  r = E.multi_question(model, tokenizer, text_ids, **kwargs)
  assert r["cases"] == 2 and r["failed"] == 0 and r["questions"] == len(r["answers"]) == 8
  assert r["accuracy"] == r["correct"] / 8 and r["peak_kv_bytes"] > 0
  assert [a["case"] for a in r["answers"]] == [0] * 4 + [1] * 4
  assert all(isinstance(a["answer"], str) for a in r["answers"])
  monkeypatch.setattr(_answers, "prefill", _failing_second_call(_answers.prefill))
  r = E.multi_question(model, tokenizer, text_ids, **kwargs)
  assert r["failed"] == 1 and r["errors"] == ["RuntimeError: boom"] and r["questions"] == 8
  assert [a["answer"] for a in r["answers"][4:]] == [None] * 4
  for bad, message in [
      (dict(facts=0), "facts must be an int >= 1, got 0"),
      (dict(facts=13), "facts must be <= 12"),
  ]:
    with pytest.raises(ValueError, match=message):
      E.multi_question(model, tokenizer, text_ids, **{**kwargs, **bad})
  with pytest.raises(ValueError, match="has 150 tokens, too short for a window of 200 tokens"):
    E.multi_question(model, tokenizer, text_ids[:150], **kwargs)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_answer_is_the_greedy_continuation_and_rejects_empty_input(tokenizer, monkeypatch):
  """The answer is the greedy continuation of the chat template's opening, the context, the
  question and the template's closing: with the full cache what `kvjax.generate` gives for
  those ids; with a spec what the session API gives (context compressed to the budget,
  then the question, protected, then decode)."""
  # Sharp attention (the fixture's is near uniform): the answer depends on the question,
  # the context and what compression keeps, so a prompt built otherwise answers otherwise.
  model = tiny_llama(vocab_size=tokenizer.vocab_size, max_context=2048, qk_scale=20)
  context, question, n = "Paris is in France. " * 20, "Where is Paris?", 3
  marker = "\x00marker\x00"
  before, after = tokenizer.apply_chat_template([{"role": "user", "content": marker}]).split(marker)
  opening, context_ids = tokenizer.encode(before), tokenizer.encode(context)
  question_ids = tokenizer.encode("\n\n" + question) + tokenizer.encode(after)
  held = []  # K/V tokens per head after answer's prefill of the context

  def prefill(*args, **kw):
    state = kvjax.prefill(*args, **kw)
    held.append(int(state.cache.length.max()))
    return state

  monkeypatch.setattr(_answers, "prefill", prefill)
  text = E.answer(model, tokenizer, context, question, max_new_tokens=n)
  ids = opening + context_ids + question_ids
  expected = kvjax.generate(model, tokenizer, [ids], max_new_tokens=n)
  assert expected.tokens[0] and text.strip()
  assert text == tokenizer.decode(expected.tokens[0], skip_special_tokens=True)
  spec = kvjax.CompressionSpec(policy="h2o", budget=48)
  compressed = E.answer(model, tokenizer, context, question, spec, max_new_tokens=n)
  assert held == [len(opening) + len(context_ids), 48]
  prompt = [kvjax.Segment(opening, protected=True), kvjax.Segment(context_ids)]
  state = kvjax.prefill(model, [prompt], spec, reserve=len(question_ids) + n)
  state = kvjax.extend(model, state, [[kvjax.Segment(question_ids, protected=True)]])
  _, result = kvjax.decode(model, state, n, stop_tokens=tokenizer.eos_ids)
  assert result.tokens[0] and compressed.strip()
  assert compressed == tokenizer.decode(result.tokens[0], skip_special_tokens=True)
  assert compressed != text  # 48 of the 125 tokens kept: this model answers otherwise
  with pytest.raises(ValueError, match="question must be a non-empty string"):
    E.answer(model, tokenizer, "context", " ")
  with pytest.raises(ValueError, match="context is empty"):
    E.answer(model, tokenizer, "", "Why?")


@pytest.mark.parametrize(
    "policy, budget, message",
    [
        ("h2o", 900, "budget=900 .900 tokens. is larger than the request of 256 tokens"),
        ("h2o", 4, r"budget=4 cannot hold the protected sink=4 and recent=1 tokens: it needs >= 5"),
        ("h2o", 1.5, r"a fractional budget must be in \(0, 1\), got 1.5"),
        ("h2o", None, "policy 'h2o' evicts to a budget"),
        ("nope", 64, "unknown policy 'nope'"),
    ],
)
def test_bad_budgets_and_policies_raise_before_anything_runs(policy, budget, message):
  with pytest.raises(ValueError, match=message):
    _answers.resolve_budget(kvjax.CompressionSpec(policy=policy, budget=budget), 256)


def test_resolve_budget_rounds_fractions_to_whole_groups():
  spec = kvjax.CompressionSpec
  assert _answers.resolve_budget(spec(), 256) is None
  assert _answers.resolve_budget(spec("h2o", 0.3), 256) == 76  # token eviction
  assert _answers.resolve_budget(spec("group_history", 0.3), 256) == 64  # whole 16-token pages


def test_a_fraction_of_a_short_prompt_keeps_the_protected_tokens():
  """A tuned fraction meets a prompt too short for its sink and recent window: it keeps
  the floor instead of failing (strict, for the tuner, still refuses)."""
  spec = kvjax.CompressionSpec("h2o", 0.1295)  # 31 tokens -> 3, below sink 4 + recent
  tokens = spec.budget_tokens(31)
  floor = kvjax.spec.min_budget(spec.page_size, spec.sink, spec.recent_tokens(tokens), 1)
  assert tokens == floor == 5
  with pytest.raises(ValueError, match="cannot hold the protected sink=4"):
    spec.budget_tokens(31, strict=True)
  assert kvjax.CompressionSpec("group_history", 0.01).budget_tokens(100) % 16 == 0


@pytest.mark.slow  # ~11 s: -m slow
def test_windowed_fidelity_full_cache_is_exact_and_references_are_reused(
    model, tokenizer, text_ids
):
  references = {}
  kwargs = dict(context_tokens=96, continuation_tokens=8, windows=2, references=references)
  full = E.windowed_fidelity(model, tokenizer, text_ids, **kwargs)
  assert full["kl"] == 0.0 and full["top1"] == 1.0 and full["ppl"] == full["ppl_full"]
  assert full["kept_fraction"] == 1.0
  assert len(references) == 2 and full["cases"] == 2 and full["failed"] == 0
  spec = kvjax.CompressionSpec(policy="tova", budget=32)
  squeezed = E.windowed_fidelity(model, tokenizer, text_ids, spec=spec, **kwargs)
  assert len(references) == 2  # the full cache ran once per window
  assert squeezed["kl"] > 0.0 and squeezed["ppl_full"] == pytest.approx(full["ppl"], rel=1e-6)
  assert squeezed["kept_fraction"] <= (32 + 16) / 96  # the budget plus the eviction margin
  ppl = E.perplexity(model, tokenizer, text_ids, **kwargs)
  assert set(ppl) == {
      "ppl",
      "ppl_full",
      "kept_fraction",
      "kv_bytes",
      "peak_kv_bytes",
      "cases",
      "failed",
      "errors",
  }
  with pytest.raises(
      ValueError,
      match=r"too short for 3 window.s. of 96 context \+ 8 continuation tokens .312 needed",
  ):
    E.windowed_fidelity(
        model, tokenizer, text_ids[:300], context_tokens=96, continuation_tokens=8, windows=3
    )


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_crashed_case_is_counted_and_shown_not_skipped(model, tokenizer, text_ids, monkeypatch):
  monkeypatch.setattr(_tasks, "fidelity", _failing_second_call(_tasks.fidelity))
  r = E.windowed_fidelity(
      model, tokenizer, text_ids, context_tokens=64, continuation_tokens=4, windows=2
  )
  assert r["cases"] == 2 and r["failed"] == 1 and r["errors"] == ["RuntimeError: boom"]
  assert r["kl"] == 0.0  # the mean of the case that ran


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_instruction_retention_full_keeps_all_and_a_budget_loses_some(model, tokenizer, text_ids):
  full = E.instruction_retention(model, tokenizer, text_ids, context_tokens=256)
  assert full["retention"] == 1.0 and full["retained_all"] == 1.0 and full["cases"] == 3
  tight = E.instruction_retention(
      model,
      tokenizer,
      text_ids,
      context_tokens=256,
      spec=kvjax.CompressionSpec(policy="streaming", budget=64),
      depths=(0.5,),
  )
  # Streaming keeps the sink and the recent window: a mid-context instruction is gone.
  assert tight["retention"] == 0.0 and tight["cases"] == 1
  with pytest.raises(ValueError, match="depths must be a non-empty list of fractions"):
    E.instruction_retention(model, tokenizer, text_ids, context_tokens=256, depths=(1.5,))


@pytest.mark.slow  # a sweep per policy; test_hardening's sweep test covers saving rows by default
def test_sweep_results_follow_the_schema_and_crashed_configs_are_rows(sweep, monkeypatch, tmp_path):
  real = _sweep._run_one

  def crash_on_tova(task, model, tokenizer, length, spec, *args):
    if spec.policy.name == "tova":
      raise RuntimeError("kernel exploded")
    return real(task, model, tokenizer, length, spec, *args)

  monkeypatch.setattr(_sweep, "_run_one", crash_on_tova)
  policies = ["full", "h2o", "tova"]
  results = sweep("fidelity", policies, [0.5, 32], [64, 96], options=SHORT_FIDELITY)
  E.validate_results(results)
  rows = results["rows"]
  assert len(rows) == 2 * (1 + 2 * 2)
  crashed = [r for r in rows if r["policy"] == "tova"]
  assert all(r["failed"] == 1 and r["metrics"]["kl"] is None for r in crashed)
  assert [r["budget_tokens"] for r in rows[:5]] == [None, 32, 32, 32, 32]
  written = E.write_results(results, tmp_path)
  assert json.loads((tmp_path / "results.json").read_text()) == results
  md = (tmp_path / "results.md").read_text()
  assert (
      "## Errors (cases that crashed; they count as wrong)" in md
      and "RuntimeError: kernel exploded" in md
      and "| tova | 0.5 |" in md
  )
  pngs = [p for p in written if p.suffix == ".png"]
  assert {p.name for p in pngs} == {"kl_vs_budget.png", "top1_vs_budget.png"}
  assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


@pytest.mark.slow  # a question task's sweep: passkey's runs by default
def test_multi_question_sweep_reports_questions_and_the_full_cache_accuracy(sweep, tmp_path):
  options = {"facts": 4, "trials": 1}
  results = sweep("multi_question", ["full", "h2o"], [0.5], [200], options=options)
  E.validate_results(results)
  rows = results["rows"]
  assert [r["metrics"]["questions"] for r in rows] == [4.0, 4.0]
  assert all(len(r["answers"]) == 4 and r["failed"] == 0 for r in rows)
  names = {p.name for p in E.write_results(results, tmp_path)}
  assert names == {"results.json", "results.md", "accuracy_vs_budget.png"}
  md = (tmp_path / "results.md").read_text()
  assert "| accuracy | correct | questions | peak_kv_bytes | full-cache accuracy |" in md
  with pytest.raises(ValueError, match="facts must be an int >= 1"):
    sweep("multi_question", ["full"], [], [200], options={"facts": 0})


@pytest.mark.slow  # heavy: run with -m slow
def test_bench_sweep_reports_cost_per_length(sweep, tmp_path):
  options = {"decode_steps": 4, "repeats": 1}
  results = sweep("bench", ["full", "streaming"], [32], [64, 128], options=options)
  E.validate_results(results)
  by = {(r["policy"], r["context_tokens"]): r["metrics"] for r in results["rows"]}
  assert by["streaming", 128]["kv_bytes_final"] < by["full", 128]["kv_bytes_final"]
  assert by["full", 64]["eviction_share"] == 0.0
  names = {p.name for p in E.write_results(results, tmp_path)}
  assert {"kv_bytes_peak_vs_length.png", "decode_ms_per_token_vs_length.png"} <= names


def test_validate_rejects_results_off_the_schema(model):
  good = _report.new_results("passkey", model, {})
  good["rows"].append(
      {
          "policy": "full",
          "budget": None,
          "budget_tokens": None,
          "context_tokens": 128,
          "cases": 2,
          "failed": 1,
          "errors": ["RuntimeError: x"],
          "seconds": 1.0,
          "metrics": {"accuracy": 0.5, "correct": 1.0, "peak_kv_bytes": None},
      }
  )
  E.validate_results(good)
  for breaks, message in [
      (lambda r: r.pop("versions"), "missing 'versions'"),
      (lambda r: r.update(task="chat"), "task is 'chat'"),
      (lambda r: r["rows"][0].update(failed=3), "failed/cases = 3/2"),
      (lambda r: r["rows"][0].update(errors=[]), "has 0 errors"),
      (lambda r: r["rows"][0]["metrics"].pop("accuracy"), "metrics keys"),
      (lambda r: r["rows"][0]["metrics"].update(accuracy="high"), "metrics.accuracy = 'high'"),
      (lambda r: r["rows"][0].update(context_tokens=1.5), "context_tokens = 1.5"),
      (lambda r: r["rows"][0].update(budget="most"), "budget = 'most'"),
  ]:
    broken = json.loads(json.dumps(good))
    breaks(broken)
    with pytest.raises(ValueError, match=message):
      E.validate_results(broken)


@pytest.mark.parametrize(
    "name, content, fields, match",
    [
        ("missing.txt", None, None, "cannot read text file .*missing.txt"),
        ("empty.txt", "  \n", None, "is empty"),
        ("bad.jsonl", '{"text": "a"}\n{oops\n', ("text",), "bad.jsonl:2: not valid JSON"),
        (
            "field.jsonl",
            '{"context": "a", "question": "b"}\n',
            ("context", "question", "answer"),
            r"field.jsonl:1: needs string field\(s\) \['answer'\]",
        ),
    ],
)
def test_data_files_fail_clearly(tmp_path, name, content, fields, match):
  path = tmp_path / name
  if content is not None:
    path.write_text(content)
  with pytest.raises(FileNotFoundError if content is None else ValueError, match=match):
    _data.read_text(path) if fields is None else _data.read_jsonl(path, fields)


@pytest.mark.slow  # tests/test_tune.py writes and loads allocations by default
def test_a_sweep_records_the_head_allocation_its_rows_used(model, sweep):
  """--spec tuned.json with an allocation: the results say so (it applies to its policy)."""
  shape = (model.config.n_layers, model.config.n_kv_heads)
  allocation = HeadAllocation(
      offsets=np.zeros(shape, np.float32),
      policy="kvzip",
      log_scores=True,
      scale=1.0,
      model="tiny",
      fingerprint=model_fingerprint(model),
  )
  spec = kvjax.CompressionSpec(policy="kvzip", budget=32, allocation=allocation)
  results = sweep("fidelity", ["full", "kvzip"], [32], [64], spec=spec, options=SHORT_FIDELITY)
  E.validate_results(results)
  assert results["config"]["spec"]["allocation"] == {"policy": "kvzip", "path": None}
  without = sweep("fidelity", ["full"], [], [64], options=SHORT_FIDELITY)
  assert without["config"]["spec"]["allocation"] is None


def test_a_model_without_a_chat_template_reads_a_cued_plain_question():
  from kvjax.testing import ByteTokenizer

  tok = ByteTokenizer()  # no chat template: a base model
  ids = _answers.encode_question(tok, _data.PASSKEY_QUESTION, True, _data.PASSKEY_CUE)
  assert tok.decode(ids) == f"\n\nQuestion: {_data.PASSKEY_QUESTION}\nAnswer: The pass key is"
  assert _answers.chat_parts(tok, True) == ([], [])
  # A built-in case carries its cue (the door asked in a 'needles' case).
  (case,) = _tasks.passkey_cases(
      tok, 600, depths=[0.5], trials=1, fillers=("needles",), ids=list(range(40, 120)) * 40
  )
  assert case["cue"] == _data.DOOR_CUE.format(door=case["door"])


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_chat_model_reads_the_question_in_its_template_without_a_cue():
  tok = Tokenizer.from_gguf(resolve_model().path)
  ids = _answers.encode_question(tok, "What is it?", True, "It is")
  text = tok.decode(ids)
  assert "What is it?" in text and "It is" not in text and "<|im_start|>assistant" in text


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_text_windows_read_as_documents_begin_with_the_bos_a_tokenizer_adds(monkeypatch):
  class BosTokenizer:
    add_bos, bos_id = True, 1

  assert _data.document_start(BosTokenizer()) == [1]
  assert _data.document_start(Tokenizer.from_gguf(resolve_model().path)) == []  # SmolLM2
  pairs = _data.text_windows(list(range(10, 110)), 10, 2, 3, [1])
  assert all(len(c) == 10 and c[0] == 1 and c[1] != 1 for c, _ in pairs)
  seen = []
  monkeypatch.setattr(
      _tasks, "continuation_logits", lambda m, context, *a, **k: seen.append(context) or (None,)
  )
  metrics = dict(kl=0.0, top1=1.0, ppl=1.0, ppl_full=1.0, kept_fraction=1.0, kv_bytes=0)
  monkeypatch.setattr(_tasks, "fidelity", lambda *a, **k: {**metrics, "peak_kv_bytes": 0})
  _tasks.windowed_fidelity(
      None,
      BosTokenizer(),
      list(range(10, 410)),
      context_tokens=64,
      continuation_tokens=8,
      windows=2,
  )
  assert seen and all(c[0] == 1 and len(c) == 64 for c in seen)
