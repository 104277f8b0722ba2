"""The flags of the `kvjax.CompressionSpec` and `kvjax.Sampling` fields, generated from the
dataclasses in one table, and the spec a parsed command line gives."""

from __future__ import annotations

import argparse
import dataclasses


def parse_budget(text: str) -> int | float | str:
  """'512' -> 512 tokens; '0.25' -> a quarter of the prompt; 'auto' -> what scores above
  --threshold."""
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    try:
      return float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"budget must be tokens, a fraction or 'auto', got {text!r}"
      ) from None


_SWEPT = ("policy", "budget")  # eval/bench take several of these and run each
# eval/bench set these per configuration: the threshold where the budget is 'auto', the
# scorer where the policy is 'learned', the allocation where the policy is its own.
_PER_CONFIG = (*_SWEPT, "threshold", "scorer", "allocation")


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _policy_names() -> list[str]:
  from kvjax.policies import POLICIES

  return list(POLICIES)


def add_dataclass_flags(parser, cls, *, sweep: bool = False, title: str) -> None:
  """One flag per field of `cls` (CompressionSpec or Sampling), with its help and choices.
  Flags default to None: the dataclass's own defaults apply to what the user leaves out."""
  group = parser.add_argument_group(title)
  if cls.__name__ == "CompressionSpec":
    group.add_argument(
        "--spec",
        default=None,
        metavar="FILE",
        help="a tuned spec (tuned.json from `kvjax tune`); flags given with it override it",
    )
    group.add_argument(
        "--policy-module",
        default=None,
        metavar="MODULE",
        help="import this Python module (a dotted name, or a .py file) before the spec is "
        "read, so that the policies it registers (kvjax.policies.register) can be named by "
        "--policy; it is your code and runs as it is",
    )
  for field in dataclasses.fields(cls):
    meta = dict(field.metadata)
    default = field.default
    help_text = meta.get("help", "") + ("" if default is None else f" (default: {default})")
    kwargs = {"default": None, "dest": field.name, "help": help_text.replace("%", "%%")}
    if field.name == "policy":
      kwargs["metavar"] = "POLICY"
      names = ", ".join(_policy_names()) + (", or 'all'" if sweep else "")
      kwargs["help"] = (
          f"eviction policy: one of {names}, with options after a colon where it has any "
          f"(kvzip:chunk=256), or one a --policy-module registers; 'full' keeps every token "
          f"(default: {'all' if sweep else default})"
      )
    elif field.name == "budget":
      kwargs["type"] = parse_budget
    elif isinstance(default, bool):
      kwargs["action"] = argparse.BooleanOptionalAction
    elif "choices" in meta:
      kwargs["choices"] = meta["choices"]
    elif field.type in ("int", "int | None"):
      kwargs["type"] = int
    elif field.type in ("float", "float | None"):
      kwargs["type"] = float
    if sweep and field.name in _SWEPT:
      kwargs["nargs"] = "+"
    group.add_argument(_flag(field.name), **kwargs)


def _given(cls, args, skip=()) -> dict:
  """The fields of `cls` the user gave flags for."""
  return {
      f.name: getattr(args, f.name)
      for f in dataclasses.fields(cls)
      if f.name not in skip and getattr(args, f.name, None) is not None
  }


def from_args(cls, args, skip=()):
  """`cls` built from the flags the user gave (the others keep the dataclass defaults)."""
  return cls(**_given(cls, args, skip))


def spec_from_args(args, sweep: bool = False):
  """The `CompressionSpec` of a parsed command line: `--spec FILE` (a tuned spec) with the
  flags given on top, or the flags alone (for eval/bench: without the fields each
  configuration sets, `_PER_CONFIG`)."""
  from kvjax.spec import CompressionSpec

  if getattr(args, "policy_module", None) is not None:
    import_policy_module(args.policy_module)
  skip = _PER_CONFIG if sweep else ()
  if getattr(args, "spec", None) is None:
    return from_args(CompressionSpec, args, skip=skip)
  from kvjax.tuning import load_spec

  tuned = load_spec(args.spec)
  given = _given(CompressionSpec, args, skip)
  if "policy" in given and given["policy"] != tuned.policy.name:
    given.setdefault("allocation", None)  # learned on the tuned policy's scores
  return tuned.replace(**given)


def import_policy_module(name: str) -> None:
  """Imports `name` (a dotted module name, or the path of a .py file) for the policies it
  registers; ValueError naming it when it cannot be found (its own errors propagate)."""
  import importlib
  import importlib.util
  import pathlib
  import sys

  if name.endswith(".py"):
    path = pathlib.Path(name)
    if not path.is_file():
      raise ValueError(f"--policy-module {name}: no such file")
    spec = importlib.util.spec_from_file_location(f"kvjax_policy_module_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as err:
    if err.name and name.startswith(err.name):
      raise ValueError(
          f"--policy-module {name}: no such module (give a dotted module name on the Python "
          "path, or a .py file)"
      ) from None
    raise


def check_spec_model(args, model, *specs) -> None:
  """A tuned spec (`--spec`) must have been tuned for the model it runs with; each of
  `specs` must fit it too: its policy (a learned scorer), its allocation, and every size it
  gives within the model context (checked here, before the work begins, as a usage error:
  `kvjax.prefill` checks them too, once it runs)."""
  from kvjax.seam import ModelShape

  if getattr(args, "spec", None) is not None:
    from kvjax.tuning import load_spec

    load_spec(args.spec, model)
  max_context = ModelShape.of(model).max_context
  for spec in specs:
    spec.check_context(max_context)
    spec.policy.check_model(model)
    if spec.allocation is not None:
      spec.allocation.check_model(model)
