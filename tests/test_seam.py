"""The seam: models/ knows nothing of kvjax; any model with `run` plugs in; the CLI reaches
every CompressionSpec field."""

import ast
import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import kvjax
from kvjax.policies.learned import shipped_path
import kvjax.testing
from kvjax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_models_import_nothing_from_kvjax_or_pallas_kernels():
  offenders = []
  for path in sorted((ROOT / "models").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        names = [node.module or ""]
      offenders += [
          f"{path.name}:{node.lineno} {n}"
          for n in names
          if n.split(".")[0] in ("kvjax", "pallas_kernels")
      ]
  assert not offenders, offenders


def _example(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses resolve annotations through it
  spec.loader.exec_module(module)
  return module


def test_custom_model_generates_the_same_tokens_through_the_seam_as_with_its_own_attention():
  ex = _example("custom_model")
  from flax import nnx

  model = ex.TinyDecoder(ex.TinyConfig(n_layers=2), nnx.Rngs(1))
  ids = list(range(3, 60))
  through_seam = kvjax.generate(model, kvjax.testing.ByteTokenizer(), [ids], max_new_tokens=6)
  assert through_seam.tokens[0] == ex.plain_greedy(model, ids, 6)


# custom_model's seam is tested directly above; running its script is slow.
@pytest.mark.parametrize(
    "name, args",
    [pytest.param("custom_model", [], marks=pytest.mark.slow), ("custom_policy", ["--tiny"])],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_examples_run(name, args):
  run = subprocess.run(
      [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  if name == "custom_model":
    assert "own attention: True" in run.stdout
  else:
    assert "peak_attention:" in run.stdout and "vnorm:" in run.stdout


# A value for every CompressionSpec field, other than its default, that the CLI must deliver.
NON_DEFAULT = {
    "policy": ("h2o", "h2o"),
    "budget": ("96", 96),
    "budget_schedule": ("pyramid", "pyramid"),
    "head_budget": ("layer", "layer"),
    "sink": ("8", 8),
    "recent": ("24", 24),
    "page_size": ("8", 8),
    "group_size": ("1", 1),
    "group_reduce": ("max", "max"),
    "fair": (None, True),
    "prefill_chunk": ("64", 64),
    "attention_impl": ("ref", "ref"),
    "kv_dtype": ("bfloat16", "bfloat16"),
}


# The fields that only a compress-once policy takes, checked on their own spec.
COMPRESS_ONCE = {
    "policy": ("learned", "learned"),
    "budget": ("auto", "auto"),
    "compress": ("once", "once"),
    "threshold": ("-4.5", -4.5),
    "scorer": (str(shipped_path()), str(shipped_path())),
}


def _argv(fields=NON_DEFAULT):
  argv = []
  for name, (text, _) in fields.items():
    argv += [f"--{name.replace('_', '-')}"] + ([] if text is None else [text])
  return argv


def test_every_spec_field_has_a_cli_flag_that_reaches_the_spec():
  fields = {f.name for f in dataclasses.fields(kvjax.CompressionSpec)}
  # (allocation: test_the_allocation_flag_reaches_the_spec)
  assert fields == set(NON_DEFAULT) | set(COMPRESS_ONCE) | {
      "allocation"
  }, "a new field needs a case"
  for cases in (NON_DEFAULT, COMPRESS_ONCE):
    args = cli.build_parser().parse_args(["generate", "hi", *_argv(cases)])
    spec = cli.spec_from_args(args)
    for name, (_, value) in cases.items():
      got = spec.policy.name if name == "policy" else getattr(spec, name)
      assert got == value, name
  # eval/bench: the same flags, policy and budget swept.
  args = cli.build_parser().parse_args(["eval", "fidelity", *_argv(), "--policy", "h2o", "tova"])
  assert args.policy == ["h2o", "tova"] and args.budget == [96]
  swept = cli.spec_from_args(args, sweep=True)
  assert swept.sink == 8 and swept.kv_dtype == "bfloat16" and swept.policy.name == "full"


def test_the_allocation_flag_reaches_the_spec(tmp_path):
  import numpy as np

  from kvjax.eviction.allocation import HeadAllocation

  saved = HeadAllocation(np.zeros((2, 2), np.float32), "kvzip", True, 1.0, "tiny", "x")
  path = str(saved.save(tmp_path / "allocation").path)
  argv = ["generate", "hi", "--policy", "kvzip", "--budget", "0.25", "--allocation", path]
  spec = cli.spec_from_args(cli.build_parser().parse_args(argv))
  assert spec.allocation == saved and spec.allocation.path == path


def test_generate_help_lists_every_spec_field():
  text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
  for f in dataclasses.fields(kvjax.CompressionSpec):
    assert f"--{f.name.replace('_', '-')}" in text, f.name
  for f in dataclasses.fields(kvjax.Sampling):
    assert f"--{f.name.replace('_', '-')}" in text, f.name


def test_cli_rejects_a_bad_spec_before_loading_the_model(capsys):
  assert cli.main(["generate", "hi", "--policy", "h2o", "--budget", "-5"]) == 2
  err = capsys.readouterr().err
  assert "budget must be a positive int" in err and "loading" not in err


def test_the_fingerprint_reads_every_byte_of_every_weight(tmp_path):
  """One weight far into a tensor, changed by one float32 ulp (invisible to a digest of the
  first values, rounded): another fingerprint, and a state saved for the first model is
  refused by the second."""
  import jax.numpy as jnp
  import numpy as np

  from kvjax.fingerprint import model_fingerprint

  model, other = kvjax.testing.tiny_llama(), kvjax.testing.tiny_llama()
  assert model_fingerprint(model) == model_fingerprint(other)
  name, param = max(_params(other), key=lambda item: item[1][...].size)
  values = np.array(param[...])
  assert values.size > 1024, name
  flat = values.reshape(-1)
  flat[-1] = np.nextafter(flat[-1], np.float32(np.inf))
  param[...] = jnp.asarray(values)  # a new array: the cached fingerprint is not reused
  assert model_fingerprint(other) != model_fingerprint(model)

  state = kvjax.prefill(model, [[1, 2, 3, 4, 5]])
  path = kvjax.save_state(tmp_path / "s", state, model)
  with pytest.raises(kvjax.StateFileError, match="other weights"):
    kvjax.load_state(path, other)


def _params(model):
  from flax import nnx

  for path, param in nnx.iter_graph(model):
    if isinstance(param, nnx.Param):
      yield ".".join(map(str, path)), param
