"""A sandbox for chat templates: jinja2's immutable sandbox, with every render charged to one
budget of sizes, steps and time (the template comes with the model's files, not from kvjax)."""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Mapping, Sequence

# A chat template comes with the model's files (GGUF metadata, tokenizer_config.json), so one
# render of it is bounded: a hostile template fails in one line (ValueError "chat template:
# ... exceeds ...") instead of burning CPU or memory. Each bound is far above what a real
# template needs for a long conversation (they print each message once, plus a few hundred
# characters of their own, in a few dozen steps per message):
# - a value a render makes (a string, a list, the output) holds at most
#   _TEMPLATE_BASE_CHARS + _TEMPLATE_CHARS_PER_INPUT_CHAR characters per character of the
#   messages, checked before the operations that can multiply sizes ('*', str.replace, the
#   `center` filter, ...) and after every other;
# - a render takes at most _TEMPLATE_BASE_STEPS + _TEMPLATE_STEPS_PER_MESSAGE steps per
#   message: a loop iteration, an operator, a filter or a piece of text is a step, a call
#   (a method, a macro, a global function) _TEMPLATE_CALL_STEPS, about what it costs
#   beside a loop iteration, so no kind of step makes the bound slow to reach (a fraction
#   of a second); and _TEMPLATE_SECONDS, checked at the steps, for steps made slow on purpose;
# - an integer holds at most _TEMPLATE_INT_BITS bits (`7 ** 100000000` is refused, not computed).
_TEMPLATE_BASE_CHARS = 1 << 20
_TEMPLATE_CHARS_PER_INPUT_CHAR = 8
_TEMPLATE_BASE_STEPS = 500_000
_TEMPLATE_STEPS_PER_MESSAGE = 1_000
_TEMPLATE_CALL_STEPS = 16
_TEMPLATE_SECONDS = 5.0
_TEMPLATE_INT_BITS = 4096
_SEQUENCES = (str, bytes, list, tuple)


class RenderBudget:
  """What one render of a chat template may spend; ValueError naming the bound it exceeds."""

  def __init__(self, input_chars: int, messages: int):
    self.max_chars = _TEMPLATE_BASE_CHARS + _TEMPLATE_CHARS_PER_INPUT_CHAR * input_chars
    self.max_steps = _TEMPLATE_BASE_STEPS + _TEMPLATE_STEPS_PER_MESSAGE * messages
    self.steps = 0
    self.deadline = time.monotonic() + _TEMPLATE_SECONDS

  def step(self, cost: int = 1) -> None:
    before, self.steps = self.steps, self.steps + cost
    if self.steps > self.max_steps:
      raise ValueError(
          f"chat template: rendering exceeds {self.max_steps} steps ({_TEMPLATE_BASE_STEPS} + "
          f"{_TEMPLATE_STEPS_PER_MESSAGE} per message; a loop iteration, an operator or a "
          f"filter is a step, a call {_TEMPLATE_CALL_STEPS})"
      )
    if before >> 6 != self.steps >> 6 and time.monotonic() > self.deadline:
      raise ValueError(f"chat template: rendering exceeds {_TEMPLATE_SECONDS:g} s")

  def check_chars(self, chars: int, what: str) -> None:
    if chars > self.max_chars:
      raise ValueError(
          f"chat template: {what} ({chars} characters) exceeds the limit of {self.max_chars} "
          f"characters ({_TEMPLATE_BASE_CHARS} + {_TEMPLATE_CHARS_PER_INPUT_CHAR} per "
          "character of the messages)"
      )

  def check_value(self, value, what: str) -> None:
    self.check_chars(len(value) if type(value) is str else _chars(value, self.max_chars), what)

  def check_int_bits(self, bits: int, what: str) -> None:
    if bits > _TEMPLATE_INT_BITS:
      raise ValueError(
          f"chat template: {what} (about {bits} bits) exceeds the limit of "
          f"{_TEMPLATE_INT_BITS} bits"
      )


def _chars(value, limit: int) -> int:
  """About len(str(value)): a container counts every item each time it holds it (so shared
  items cannot hide a large text), counted only until the total passes `limit` (at most
  O(limit) work whatever `value` is)."""
  if type(value) is str:
    return len(value)
  total, pending = 0, [value]
  while pending and total <= limit:
    item = pending.pop()
    if isinstance(item, (str, bytes, bytearray)):
      total += len(item)
    elif isinstance(item, int):
      total += item.bit_length() * 3 // 10 + 2  # decimal digits
    elif isinstance(item, (list, tuple, set, frozenset)):
      total += 2 + 4 * len(item)  # brackets; per item quotes and ", "
      if total <= limit:
        pending.extend(item)
    elif isinstance(item, Mapping):
      total += 2 + 6 * len(item)
      if total <= limit:
        pending.extend(item.keys())
        pending.extend(item.values())
    else:  # a float, None, an undefined value, a generator, jinja2's helpers
      total += 24
  return total


def _as_int(value) -> int:
  """An int argument as it is, anything else as 0 (the operation raises its own TypeError)."""
  return value if isinstance(value, int) else 0


def _nth(args: tuple, kwargs: Mapping, i: int, name: str, default=None):
  """Argument `i` (or keyword `name`) of a call, `default` when not given."""
  return args[i] if len(args) > i else kwargs.get(name, default)


def _format_chars(fmt: str, style: str, values: Sequence, limit: int) -> int:
  """About the length of `fmt` formatted with `values` ('%' or '{}' style): each field
  prints at most the longest value, padded to at most the widest width the format names
  (or an int value, where a field takes its width from the values: '%*s', '{:{}}')."""
  fields = fmt.count("%" if style == "%" else "{")
  widths = [int(n) if len(n) <= 12 else 10**12 for n in re.findall(r"\d+", fmt)]
  if ("*" in fmt) if style == "%" else re.search(r"\{[^{}]*\{", fmt):
    widths += [v for v in values if isinstance(v, int)]
  longest = max((_chars(v, limit) for v in values), default=0)
  return len(fmt) + fields * (longest + max(widths, default=0))


def _replace_chars(s: str, old, new, count) -> int | None:
  if not isinstance(old, str) or not isinstance(new, str):
    return None
  found = s.count(old) if old else len(s) + 1
  if isinstance(count, int) and count >= 0:
    found = min(found, count)
  return len(s) + found * max(len(new) - len(old), 0)


def _str_method_chars(s: str, name: str, args: tuple, kwargs: Mapping, limit: int) -> int | None:
  """About the length of `s.<name>(*args, **kwargs)` for the str methods whose result can be
  far longer than `s` and their arguments; None for the others (checked once made)."""
  if name in ("center", "ljust", "rjust", "zfill"):
    return max(len(s), _as_int(_nth(args, kwargs, 0, "width", 0)))
  if name == "expandtabs":
    return len(s) + s.count("\t") * max(_as_int(_nth(args, kwargs, 0, "tabsize", 8)), 0)
  if name == "replace":
    old, new = _nth(args, kwargs, 0, "old"), _nth(args, kwargs, 1, "new")
    return _replace_chars(s, old, new, _nth(args, kwargs, 2, "count", -1))
  if name == "join" and args and isinstance(args[0], _SEQUENCES):
    return _chars(args[0], limit) + len(s) * len(args[0])
  if name == "translate" and args:
    table = args[0]
    replacements = table.values() if isinstance(table, Mapping) else table
    if not isinstance(replacements, (Mapping, list, tuple, str, type({}.values()))):
      return None
    longest = max((len(r) for r in replacements if isinstance(r, str)), default=1)
    return len(s) * max(longest, 1)
  if name == "format":
    return _format_chars(s, "{}", [*args, *kwargs.values()], limit)
  if name == "format_map" and args and isinstance(args[0], Mapping):
    return _format_chars(s, "{}", list(args[0].values()), limit)
  return None


def _filter_chars(name: str, value, args: tuple, kwargs: Mapping, limit: int) -> int | None:
  """About the length of `value|name(*args, **kwargs)` for jinja2's filters whose result can
  be far longer than their input and arguments; None for the others (checked once made)."""
  arg = functools.partial(_nth, args, kwargs)
  if name == "center":
    return max(_chars(value, limit), _as_int(arg(0, "width", 80)))
  if name == "indent" and isinstance(value, str):
    width = arg(0, "width", 4)
    width = len(width) if isinstance(width, str) else _as_int(width)
    return len(value) + (value.count("\n") + 1) * max(width, 0)
  if name == "replace" and isinstance(value, str):
    count = arg(2, "count")
    return _replace_chars(value, arg(0, "old"), arg(1, "new"), -1 if count is None else count)
  if name == "join" and isinstance(value, _SEQUENCES):
    separator = arg(0, "d", "")
    separator = len(separator) if isinstance(separator, str) else 0
    return _chars(value, limit) + separator * len(value)
  if name == "format" and isinstance(value, str):
    return _format_chars(value, "%", [*args, *kwargs.values()], limit)
  if name == "wordwrap" and isinstance(value, str):
    wrap = arg(2, "wrapstring") or "\n"
    lines = len(value) // max(_as_int(arg(0, "width", 79)), 1) + 1
    return len(value) + lines * (len(wrap) if isinstance(wrap, str) else 1)
  if name in ("batch", "slice"):  # pads to `linecount` items, or makes `slices` lists
    fill = arg(1, "fill_with")
    count = _as_int(arg(0, "linecount" if name == "batch" else "slices", 0))
    return _chars(value, limit) + max(count, 0) * (4 + _chars(fill, limit))
  if name == "sum" and isinstance(arg(1, "start", 0), _SEQUENCES) and isinstance(value, Sequence):
    return _chars(value, limit) * len(value)  # adding sequences copies them each time
  if name == "tojson":
    return _chars(value, limit) * (1 + max(_as_int(arg(0, "indent", 0)), 0))
  if name in ("pprint", "string", "list"):
    return _chars(value, limit)
  return None


def _bounded_filter(budget: RenderBudget, name: str, f):
  """jinja2 filter `f` charged to `budget`: a step, its result's size checked before it is
  made where `_filter_chars` knows it, and after otherwise."""
  # jinja2 passes the context, eval context or environment first where a filter asks for it
  # (functools.wraps copies that mark, `jinja_pass_arg`, to the wrapper).
  first = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
  what = f"the result of the {name!r} filter"

  @functools.wraps(f)
  def bounded(*args, **kwargs):
    budget.step()
    if len(args) > first:
      value, rest = args[first], args[first + 1 :]
      if name == "join" and not isinstance(value, _SEQUENCES):
        value = list(value)  # measured before joining (the filter reads it once either way)
        args = (*args[:first], value, *rest)
      chars = _filter_chars(name, value, rest, kwargs, budget.max_chars)
      if chars is not None:
        budget.check_chars(chars, what)
    result = f(*args, **kwargs)
    budget.check_value(result, what)
    return result

  return bounded


def _check_operator(budget: RenderBudget, operator: str, left, right) -> bool:
  """Checks the size of `left <operator> right` before it is made, for the operators that
  can make a large value from small ones; whether it knew how (else it is checked once made)."""
  what, limit = f"the result of {operator!r}", budget.max_chars
  if operator == "*" and isinstance(left, int) and isinstance(right, int):
    budget.check_int_bits(left.bit_length() + right.bit_length(), what)
  elif operator == "*" and isinstance(left, _SEQUENCES) and isinstance(right, int):
    budget.check_chars(_chars(left, limit) * max(right, 0), what)
  elif operator == "*" and isinstance(right, _SEQUENCES) and isinstance(left, int):
    budget.check_chars(_chars(right, limit) * max(left, 0), what)
  elif operator == "**" and isinstance(left, int) and isinstance(right, int):
    if right > 0 and abs(left) > 1:
      budget.check_int_bits(math.ceil(right * math.log2(abs(left))), what)
  elif operator == "+" and isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
    budget.check_chars(_chars(left, limit) + _chars(right, limit), what)
  elif operator == "%" and isinstance(left, str):
    values = right.values() if isinstance(right, Mapping) else right
    values = list(values) if isinstance(values, (tuple, type({}.values()))) else [right]
    budget.check_chars(_format_chars(left, "%", values, limit), what)
  else:
    return False
  return True


def _call_chars(target, name: str, args: tuple, kwargs: Mapping, limit: int) -> int | None:
  """About the length of what calling `target` (named `name`) returns, for the calls whose
  result can be far longer than their arguments: str methods and jinja2's `lipsum`."""
  owner = getattr(target, "__self__", None)
  if isinstance(owner, str):
    return _str_method_chars(owner, name, args, kwargs, limit)
  if name == "generate_lorem_ipsum" and getattr(target, "__module__", "") == "jinja2.utils":
    paragraphs, words = _nth(args, kwargs, 0, "n", 5), _nth(args, kwargs, 3, "max", 100)
    return max(_as_int(paragraphs), 0) * (16 + 16 * max(_as_int(words), 0))
  return None


def _rewritten(environment, template):
  """Parsed `template` with each loop's iterable passed through `environment._counted` and
  each `~` made by `environment._concatenated` (jinja2 has no hook for either)."""
  from jinja2 import nodes
  from jinja2.visitor import NodeTransformer

  def environment_call(name, args, lineno):
    function = nodes.EnvironmentAttribute(name, lineno=lineno, environment=environment)
    return nodes.Call(function, args, [], None, None, lineno=lineno, environment=environment)

  class Rewrite(NodeTransformer):

    def visit_For(self, node):
      node = self.generic_visit(node)
      node.iter = environment_call("_counted", [node.iter], node.lineno)
      return node

    def visit_Concat(self, node):
      node = self.generic_visit(node)
      return environment_call("_concatenated", node.nodes, node.lineno)

  return Rewrite().visit(template)


@functools.cache
def bounded_sandbox_class():
  """jinja2's ImmutableSandboxedEnvironment with each render charged to a `RenderBudget`
  (a class made on first use: jinja2 is optional)."""
  import jinja2
  import jinja2.sandbox
  from jinja2.runtime import markup_join, str_join

  class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Charges to `budget` every loop iteration, call, filter, operator that can make a
    large value ('*', '**', '+', '%'), `~` concatenation, printed value and piece of
    rendered text, checking sizes (before the value is made where an operation can multiply
    them), steps and time."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, budget: RenderBudget, **options):
      self.budget = budget
      super().__init__(finalize=self._printed, **options)
      self.filters = {name: _bounded_filter(budget, name, f) for name, f in self.filters.items()}

    def compile_bounded(self, source: str):
      """The template `source`, its loops counted and its `~` checked (`_rewritten`)."""
      return self.from_string(_rewritten(self, self.parse(source)))

    def _counted(self, iterable):
      for item in iterable:
        self.budget.step()
        yield item

    @jinja2.pass_context
    def _concatenated(self, context, *pieces):
      """`a ~ b ~ ...`, as jinja2 joins it, its length checked before it is made."""
      limit = self.budget.max_chars
      self.budget.check_chars(sum(_chars(p, limit) for p in pieces), "the result of '~'")
      return (markup_join if context.eval_ctx.autoescape else str_join)(pieces)

    def _printed(self, value):
      """jinja2's `finalize` of each printed `{{ value }}`: its size checked before str()."""
      self.budget.check_value(value, "a printed value")
      return value

    def concat(self, pieces):
      """The text a render, a block or a macro makes ("".join), checked as it grows."""
      text, length = [], 0
      for piece in pieces:
        self.budget.step()
        length += len(piece)
        self.budget.check_chars(length, "the rendered text")
        text.append(piece)
      return "".join(text)

    def call_binop(self, context, operator, left, right):
      self.budget.step()
      checked = _check_operator(self.budget, operator, left, right)
      result = super().call_binop(context, operator, left, right)
      if not checked:
        self.budget.check_value(result, f"the result of {operator!r}")
      return result

    def call(self, context, obj, /, *args, **kwargs):
      # This environment's own helpers (`_counted`, `_concatenated`) are one step; the
      # arguments jinja2 adds for the context (`_loop_vars`, `_block_vars`) are not the call's.
      own = getattr(obj, "__self__", None) is self
      self.budget.step(1 if own else _TEMPLATE_CALL_STEPS)
      target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in a function
      name = getattr(target, "__name__", None) or type(obj).__name__
      joined = args[0] if name == "join" and args else ()
      if not isinstance(joined, _SEQUENCES) and isinstance(getattr(target, "__self__", None), str):
        args = (list(joined), *args[1:])  # measured before joining (join reads it once)
      given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
      chars = _call_chars(target, name, args, given, self.budget.max_chars)
      what = f"the result of {name}()"
      if chars is not None:
        self.budget.check_chars(chars, what)
      result = super().call(context, obj, *args, **kwargs)
      if not own:
        self.budget.check_value(result, what)
      return result

  return BoundedSandbox
