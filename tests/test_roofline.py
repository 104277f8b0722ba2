"""The roofline's arithmetic (what a token costs a model, from its config) and the device
check's run end to end on a CPU (what needs an accelerator skipped and said)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.roofline import ModelCosts, _better
from models.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config(**kw):
  base = dict(
      vocab_size=100, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, ffn_dim=16
  )
  return ModelConfig(**{**base, **kw})


def test_a_prefill_costs_its_linear_layers_and_causal_attention():
  costs = ModelCosts(_config())
  # per layer: q 8x16, k 8x8, v 8x8, o 16x8, gate 8x16, up 8x16, down 16x8
  assert costs.layer_weights == 2 * (128 + 64 + 64 + 128 + 3 * 128)
  flops = costs.prefill_flops(10)
  assert flops["linear"] == 2 * costs.layer_weights * 10
  # QK^T and PV: 4 H D per key seen; a causal query at position p sees p keys.
  assert flops["attention"] == 2 * 4 * 4 * 4 * sum(range(1, 11))
  assert flops["logits"] == 2 * 8 * 100  # the last token's only


def test_a_sliding_layer_reads_and_attends_to_its_window_only():
  costs = ModelCosts(_config(layer_types=("sliding", "full"), sliding_window=3))
  assert costs.windows() == [3, None]
  seen = np.minimum(np.arange(1, 11), 3).sum() + np.arange(1, 11).sum()
  assert costs.attention_flops(10) == 4 * 4 * 4 * seen
  step = costs.decode_bytes(10)
  assert step["kv"] == 2 * (3 + 10) * 2 * 4 * 4  # K and V, 2 kv heads x head_dim 4, float32
  assert step["weights"] == 4 * costs.layer_weights and step["head"] == 4 * 100 * 8
  assert costs.decode_bytes(10, kv_bytes_per_value=1)["kv"] == step["kv"] / 4


def test_the_limit_is_the_better_of_two_measurements_per_library():
  a = {"matmul_flops": {"jax": 2.0, "torch": 5.0}, "bandwidth_bytes": {"jax": 3.0}}
  b = {"matmul_flops": {"jax": 6.0, "torch": 4.0}, "bandwidth_bytes": {"jax": 1.0}}
  out = _better(a, b)
  assert out["matmul_flops"] == {"jax": 6.0, "torch": 5.0}
  assert out["matmul_limit"] == ("jax", 6.0) and out["bandwidth_limit"] == ("jax", 3.0)


@pytest.mark.slow  # ~40 s: the interpret-mode kernels, toy attention and a short roofline
def test_the_device_check_runs_end_to_end_on_a_cpu_and_says_what_it_skipped(tmp_path):
  report = tmp_path / "device.md"
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.device_check", str(report)],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  text = report.read_text()
  assert "Skipped: no GPU or TPU here" in text
  assert text.count("passed in") == 3 and "failed" not in text and "timed out" not in text
  for section in ("Kernels against their references", "Decode attention", "roofline"):
    assert section in text
  assert "| prefill 256 tokens, kvjax |" in text and "| paged | int8 |" in text
  assert (tmp_path / "device_files" / "roofline.json").is_file()
