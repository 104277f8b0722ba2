"""The `learned` policy: its scorer's formula, training with optax, orbax files tied to the
model, the threshold mode, and the memory a shared budget frees."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cli, policies
from kvjax.tuning import scorer_training as training
from kvjax.policies.learned import Scorer
from kvjax.fingerprint import model_fingerprint
from kvjax.runtime.session import context_scores
from kvjax.testing import ByteTokenizer, assert_cache_invariants, assert_compressed_once, tiny_llama

TEXT = "The vault code is 4812. Remember it while the filler goes on and on. " * 40


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=1024, n_layers=2), ByteTokenizer()


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
  model, tokenizer = tiny
  scorer = training.train_scorer(
      model,
      tokenizer,
      tokenizer.encode(TEXT),
      model_name="tiny",
      context_tokens=128,
      windows=4,
      steps=150,
      progress=False,
  )
  path = scorer.save(tmp_path_factory.mktemp("scorer") / "tiny")
  return scorer, path


def test_prediction_is_the_linear_map_of_the_normalised_hidden_state():
  weight = np.zeros((2, 4, 3), np.float32)
  weight[1, 0, 2], weight[1, 3, 0] = 2.0, -1.0
  bias = np.array([[0, 0, 0], [0.5, 0, 1]], np.float32)
  scorer = Scorer(weight, bias, model="hand", fingerprint="x")
  hidden = jnp.asarray([[[2.0, 0, 0, 2.0]]])  # [B=1, T=1, d=4]; rms = sqrt(2)
  x = np.array([2, 0, 0, 2]) / np.sqrt(2.0)
  np.testing.assert_allclose(
      np.asarray(scorer.predict(hidden, 1))[0, 0],
      [-x[3] + 0.5, 0.0, 2 * x[0] + 1.0],
      rtol=1e-5,
  )


def test_training_learns_the_kvzip_ranking_on_held_out_text(trained):
  scorer, _ = trained
  m = scorer.metrics
  assert m["held_out_windows"] == 1 and m["train_windows"] == 3
  assert m["r2"] > 0.2  # a constant predictor has R^2 = 0
  assert m["top25_overlap"] > 0.25  # random picks would find 25% of the best quarter


def test_saved_scorer_reloads_and_scores_identically(tiny, trained):
  model, tokenizer = tiny
  scorer, path = trained
  loaded = Scorer.load(path)
  assert loaded == scorer and hash(loaded) == hash(scorer)
  assert loaded.metrics == scorer.metrics and loaded.fingerprint == model_fingerprint(model)
  ids = tokenizer.encode(TEXT[:300])
  by_object = kvjax.CompressionSpec(policy=policies.Learned(scorer), budget=0.25)
  by_path = kvjax.CompressionSpec(policy="learned", budget=0.25, scorer=str(path))
  a, _ = context_scores(model, [ids], by_object)
  b, _ = context_scores(model, [ids], by_path)
  np.testing.assert_array_equal(a, b)


def test_saving_never_leaves_a_partial_directory(trained, tmp_path):
  scorer, path = trained
  with pytest.raises(FileExistsError):
    scorer.save(path)
  out = scorer.save(tmp_path / "copy")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no staging left behind
  assert Scorer.load(out) == scorer


def test_a_scorer_for_another_model_is_refused(trained):
  _, path = trained
  other = tiny_llama(max_context=1024, n_layers=2, seed=1)
  spec = kvjax.CompressionSpec(policy="learned", budget=0.25, scorer=str(path))
  with pytest.raises(ValueError, match="trained for 'tiny'.*train-scorer"):
    kvjax.prefill(other, [[1, 2, 3, 4, 5]], spec)


def test_not_a_scorer_directory_is_one_clear_error(tmp_path):
  with pytest.raises(ValueError, match="is not a trained kvjax scorer"):
    kvjax.CompressionSpec(policy="learned", budget=0.25, scorer=str(tmp_path))
  with pytest.raises(ValueError, match="scorer=.*is for policy 'learned'"):
    kvjax.CompressionSpec(policy="h2o", budget=64, scorer=str(tmp_path))


def test_threshold_keeps_exactly_the_tokens_above_it_and_the_protected(tiny, trained):
  model, tokenizer = tiny
  _, path = trained
  ids = tokenizer.encode(TEXT[:400])
  n = len(ids)
  base = kvjax.CompressionSpec(policy="learned", budget=0.5, scorer=str(path), sink=4, recent=8)
  scores, _ = context_scores(model, [ids], base)
  threshold = float(np.median(scores[..., 4 : n - 8]))
  spec = base.replace(budget="auto", threshold=threshold)
  state = kvjax.prefill(model, [ids], spec, reserve=8)
  assert_cache_invariants(state.cache)
  c = model.config
  kept_counts = []
  for layer in range(c.n_layers):
    for head in range(c.n_kv_heads):
      kept = set(kvjax.read_sequence(state.cache, layer, 0, head)[2].tolist())
      above = {i for i in range(n) if scores[layer, 0, head, i] > threshold}
      assert kept == above | set(range(4)) | set(range(n - 8, n))
      kept_counts.append(len(kept))
  assert len(set(kept_counts)) > 1  # the kept fraction differs per head


@pytest.mark.slow  # the threshold mode through a sweep; the threshold itself is tested above
def test_a_threshold_sweep_reports_the_fraction_kept(tiny, trained, tmp_path):
  from kvjax import eval as E

  model, tokenizer = tiny
  _, path = trained
  results = E.run_sweep(
      "fidelity",
      model,
      tokenizer,
      policies=["full", "learned"],
      budgets=["auto"],
      context_tokens=[200],
      ids=tokenizer.encode(TEXT),
      options={"continuation_tokens": 8, "windows": 2},
      threshold=-3.0,
      scorer=str(path),
      progress=False,
  )
  E.validate_results(results)
  full, auto = results["rows"]
  assert auto["budget"] == "auto" and auto["failed"] == 0
  assert full["metrics"]["kept_fraction"] == 1.0
  assert 0.0 < auto["metrics"]["kept_fraction"] < 1.0
  assert results["config"]["spec"]["threshold"] == -3.0
  E.write_results(results, tmp_path)
  assert "| learned | auto | above threshold |" in (tmp_path / "results.md").read_text()


def test_auto_budget_needs_a_threshold_and_a_compress_once_policy():
  with pytest.raises(ValueError, match="needs threshold="):
    kvjax.CompressionSpec(policy="kvzip", budget="auto")
  with pytest.raises(ValueError, match="evicts while it reads"):
    kvjax.CompressionSpec(policy="h2o", budget="auto", threshold=0.1)
  with pytest.raises(ValueError, match="applies only with budget='auto'"):
    kvjax.CompressionSpec(policy="kvzip", budget=0.25, threshold=0.1)


@pytest.mark.parametrize(
    "sharing", ["global", *(pytest.param(s, marks=pytest.mark.slow) for s in ("layer", "uniform"))]
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_shared_budget_frees_the_memory_it_does_not_keep(tiny, trained, sharing):
  """At 25% kept the pool holds at most 25% of the full cache's pages, plus a page per
  sequence (partial pages) and the reserve, while kept counts follow the scores."""
  model, tokenizer = tiny
  _, path = trained
  ids = tokenizer.encode(TEXT[:1000])
  n, ps, reserve = len(ids), 16, 16
  spec = kvjax.CompressionSpec(
      policy="learned", budget=0.25, scorer=str(path), head_budget=sharing, page_size=ps
  )
  state = kvjax.prefill(model, [ids], spec, reserve=reserve)
  full = kvjax.prefill(model, [ids], reserve=reserve)
  sequences = model.config.n_layers * model.config.n_kv_heads
  full_pages = sequences * -(-n // ps)
  pool_pages = state.cache.num_pages - 1  # page 0 is the null page
  assert pool_pages <= 0.25 * full_pages + sequences + sequences * -(-reserve // ps)
  assert full.cache.num_pages - 1 >= full_pages
  lengths = np.asarray(state.cache.length)[:, 0]  # [L, H]
  budget = spec.budget_tokens(n)
  assert lengths.sum() <= budget * sequences + 2  # ties aside
  if sharing == "uniform":
    assert (lengths == budget).all()
  else:
    assert len(set(lengths.ravel().tolist())) > 1
  state, result = kvjax.decode(model, state, 8)
  assert len(result.tokens[0]) == 8


def test_train_scorer_command_checks_its_options_before_loading(capsys):
  assert cli.main(["train-scorer", "--windows", "1", "--quiet"]) == 2
  assert "windows must be an int >= 2" in capsys.readouterr().err
  assert cli.main(["train-scorer", "--held-out", "1.5", "--quiet"]) == 2
  assert "held_out must be a fraction" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    ["h2o", pytest.param("h2o_mean", marks=pytest.mark.slow), "snapkv"]
    + [pytest.param("knorm", marks=pytest.mark.slow)],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_any_token_policy_can_compress_once_with_a_global_budget(name):
  model, tokenizer = tiny_llama(max_context=1024, n_layers=2, qk_scale=20.0), ByteTokenizer()
  ids = tokenizer.encode(TEXT[:600])
  n = len(ids)
  spec = kvjax.CompressionSpec(policy=name, budget=0.25, compress="once", recent=8)
  assert spec.sharing == "global"
  state = kvjax.prefill(model, [ids], spec, reserve=8)
  assert_compressed_once(state, n)
  lengths = np.asarray(state.cache.length)[:, 0]
  sequences = lengths.size
  state, result = kvjax.decode(model, state, 4)
  assert (
      len(result.tokens[0]) == 4 and int(state.cache.length.sum()) == lengths.sum() + 4 * sequences
  )


def test_compress_modes_are_checked():
  with pytest.raises(ValueError, match="compress='running' does not apply"):
    kvjax.CompressionSpec(policy="kvzip", budget=0.25, compress="running")
  with pytest.raises(ValueError, match="add compress='once'"):
    kvjax.CompressionSpec(policy="h2o", budget=64, head_budget="global", group_size=1)
  with pytest.raises(ValueError, match="compress must be one of"):
    kvjax.CompressionSpec(policy="h2o", budget=64, compress="sometimes")
  spec = kvjax.CompressionSpec(policy="h2o", budget="auto", threshold=0.5, compress="once")
  assert spec.auto and spec.once


def test_bad_scorer_and_training_arguments_are_clear_errors(tiny):
  model, tokenizer = tiny
  with pytest.raises(ValueError, match=r"weight must be \[L, d, H\] and bias \[L, H\]"):
    Scorer(np.zeros((2, 4)), np.zeros((2, 3)), model="x", fingerprint="x")
  with pytest.raises(ValueError, match="compresses the context once"):
    context_scores(model, [[1, 2, 3]], kvjax.CompressionSpec(policy="h2o", budget=64))
  for bad, match in (
      ({"learning_rate": -1.0}, "learning_rate must be a positive number"),
      ({"steps": 0}, "steps must be an int >= 1"),
      ({"context_tokens": 1100}, r"context_tokens=1100 is longer than the model context \(1024\)"),
  ):
    with pytest.raises(ValueError, match=match):
      options = {"context_tokens": 128, **bad}
      training.train_scorer(model, tokenizer, [1] * 4000, model_name="x", **options)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_scorer_with_non_finite_weights_is_refused_on_load(tmp_path, bad):
  """Written by hand (as a damaged or hostile file would be): refused by name, never used."""
  from kvjax_store import files as _files
  from kvjax.policies import learned as scorer_module

  weight = np.zeros((2, 4, 3), np.float32)
  weight[1, 2, 0] = bad
  meta = {
      "format": scorer_module.FORMAT,
      "model": "tiny",
      "fingerprint": "x",
      "num_layers": 2,
      "hidden_size": 4,
      "num_kv_heads": 3,
      "metrics": {},
  }
  path = _files.write_params(
      tmp_path / "s",
      {"weight": weight, "bias": np.zeros((2, 3), np.float32)},
      meta,
      overwrite=False,
  )
  with pytest.raises(ValueError, match=r"s: not a usable scorer: .*weight holds 1 non-finite"):
    Scorer.load(path)
  with pytest.raises(ValueError, match="non-finite"):
    kvjax.CompressionSpec(policy="learned", budget=0.25, scorer=str(path))


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_scorer_trains_on_a_model_with_sliding_layers(tmp_path):
  """Gemma 3's pattern: the scorer learns the full layers' kvzip ranking from the hidden
  states the model really has (its sliding layers attend within their windows: the scores
  `learned` gives when it compresses are the trained map of those states); a sliding layer,
  which no policy ranks, keeps zero weights."""
  from kvjax.testing import tiny_gemma3

  model, tokenizer = tiny_gemma3(window=24, n_layers=3, max_context=1024), ByteTokenizer()
  ids = tokenizer.encode(TEXT)
  scorer = training.train_scorer(
      model,
      tokenizer,
      ids,
      model_name="tiny-gemma3",
      context_tokens=128,
      windows=4,
      steps=150,
      progress=False,
  )
  full = training.full_layers(model)
  assert full.tolist() == [False, False, True]
  assert (scorer.weight[~full] == 0).all() and (scorer.bias[~full] == 0).all()
  assert scorer.metrics["r2"] > 0.2 and scorer.metrics["top25_overlap"] > 0.25
  path = scorer.save(tmp_path / "gemma")
  window = ids[:128]
  spec = kvjax.CompressionSpec(policy="learned", budget=0.5, scorer=str(path), sink=4)
  scores, _ = context_scores(model, [window], spec, tokenizer=tokenizer)
  features, _ = training.training_pairs(model, tokenizer, window, sink=4)
  expected = np.asarray(scorer.predict(jnp.asarray(features[2]), 2))  # [T', H]
  np.testing.assert_allclose(scores[2, 0, :, 4:128].T, expected, rtol=1e-4, atol=1e-4)


def test_a_model_whose_every_layer_slides_has_no_scorer_to_train():
  from kvjax.testing import tiny_gemma3

  model, tokenizer = tiny_gemma3(window=8, n_layers=2, max_context=1024), ByteTokenizer()
  with pytest.raises(ValueError, match=r"every layer of this model slides a window \(2\)"):
    training.train_scorer(
        model, tokenizer, tokenizer.encode(TEXT), model_name="x", context_tokens=128, windows=4
    )
