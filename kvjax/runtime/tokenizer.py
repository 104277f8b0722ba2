"""The tokenizer contract: what kvjax calls on a tokenizer, checked when a call starts, and
adapters that give a Hugging Face `tokenizers.Tokenizer` or a transformers tokenizer that
contract (`as_tokenizer`).

kvjax encodes the pieces of one prompt apart and joins their ids (a chat template's opening,
a context, a question), so `encode` must add nothing of its own (no BOS, no EOS): whoever
starts a sequence asks `add_bos` whether it begins with `bos_id`. A tokenizer of the
project's own (`models.Tokenizer`) meets the contract as it is; so does any object with the
members below.
"""

from __future__ import annotations

import datetime
import inspect
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from kvjax._checks import is_int

__all__ = [
    "PURPOSES",
    "ChatTokenizerLike",
    "TokenizerLike",
    "TokenizersTokenizer",
    "TransformersTokenizer",
    "as_tokenizer",
    "check_tokenizer",
]


class TokenizerLike(Protocol):
  """What kvjax calls on a tokenizer.

  Required members, by what they are needed for:

  - text prompts ("text"): `encode(text)`. Each piece of a prompt (a chat template's
    opening, a context, a question, a `Segment`) is encoded apart and the ids joined.
  - returning text ("decode"): `decode(ids, skip_special_tokens=True)`, for the result's
    texts and for every streamed piece (the pieces are the differences between decodes of
    a growing list of ids).
  - stopping ("stop"): `eos_ids`, the ids that end a row's generation (excluded from its
    tokens); `()` for none, and rows then run to `max_new_tokens`.

  Optional attributes, read with `getattr` and a default:

  - `bos_id` (default None): the beginning-of-sequence id.
  - `add_bos` (default False): whether a sequence starts with `bos_id` (Gemma's does,
    SmolLM2's does not). kvjax puts `bos_id` first in a text prompt that starts a sequence
    when this is true, unless the chat template wrote it already; token-id prompts are used
    as given.
  """

  eos_ids: Collection[int]

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, with no special tokens added (no BOS, no EOS)."""
    ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of `ids`; kvjax passes `skip_special_tokens=True`."""
    ...


class ChatTokenizerLike(TokenizerLike, Protocol):
  """A `TokenizerLike` that renders chats ("chat": `chat=True`, message prompts).

  `chat_template` is None for a base model (then `chat=True` is refused and a model is read
  as plain text); kvjax renders messages with `apply_chat_template` and encodes the text.
  """

  chat_template: str | None

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """The rendered text (not ids) of `messages`, [{"role": ..., "content": ...}], with the
    assistant's opening after them when `add_generation_prompt`. kvjax renders marker
    contents to find where a message sits, so a template must print a message's content as
    it is given."""
    ...


# What each purpose needs: (member, how the error names it, what it is needed for).
_TEXT = ("encode", "encode(text) -> list[int]", "to encode text prompts")
_CHAT_TEMPLATE = ("chat_template", "chat_template (a str, or None for a base model)", "for chat")
_CHAT_RENDER = (
    "apply_chat_template",
    "apply_chat_template(messages, add_generation_prompt=...) -> str",
    "for chat",
)
_DECODE = ("decode", "decode(ids, skip_special_tokens=...) -> str", "to return text")
_STOP = ("eos_ids", "eos_ids (a tuple of token ids that end generation)", "to stop at EOS")
_NEEDED = {
    "text": (_TEXT,),
    "chat": (_TEXT, _CHAT_TEMPLATE, _CHAT_RENDER),
    "decode": (_DECODE,),
    "stop": (_STOP,),
}
PURPOSES = tuple(_NEEDED)  # "text", "chat", "decode", "stop"
_DEFAULT_NEEDS = ("text", "decode", "stop")  # what `kvjax.generate` of text prompts calls
_CALLABLE = {"encode", "apply_chat_template", "decode"}
_MISSING = object()  # getattr's default: None is a member's value (chat_template's)
_HOW_TO_FIX = (
    "see 'Your own tokenizer' in docs/integration.md; kvjax.as_tokenizer wraps a "
    "tokenizers.Tokenizer or a transformers tokenizer"
)


def _purposes(needs) -> tuple[str, ...]:
  """`needs` as a tuple of known purposes; one purpose may be given as a str."""
  if isinstance(needs, str):
    needs = (needs,)
  if not isinstance(needs, Iterable):
    raise TypeError(f"needs must be a collection of {PURPOSES}, got {type(needs).__name__}")
  needs = tuple(needs)
  unknown = [n for n in needs if n not in _NEEDED]
  if unknown:
    raise ValueError(f"needs: unknown purpose(s) {unknown}; known: {', '.join(PURPOSES)}")
  return needs


def _takes_skip_special_tokens(decode) -> bool:
  try:
    params = inspect.signature(decode).parameters.values()
  except (TypeError, ValueError):  # a builtin without a signature: assume it does
    return True
  return any(
      p.name == "skip_special_tokens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params
  )


def _is_id_collection(value) -> bool:
  return (
      isinstance(value, Collection)  # not an iterator: checking it would use it up
      and not isinstance(value, (str, bytes, Mapping))
      and all(is_int(i) and i >= 0 for i in value)
  )


def check_tokenizer(tokenizer, needs: Iterable[str] | str = _DEFAULT_NEEDS) -> None:
  """Check that `tokenizer` has what `needs` calls for, before anything runs.

  Args:
    tokenizer: any object; nothing is called on it.
    needs: purposes among `PURPOSES`: "text" (text prompts: `encode`, and `bos_id` where
      `add_bos` is true), "chat" (`encode`, `chat_template`, `apply_chat_template`),
      "decode" (returning text: `decode` taking `skip_special_tokens`), "stop" (`eos_ids`).

  Raises:
    TypeError: one, naming every member missing or of the wrong kind and what it is needed
      for.
    ValueError: "chat" is needed and `chat_template` is None (a base model).
  """
  needs = _purposes(needs)
  if tokenizer is None:
    if not needs:
      return
    raise TypeError(
        f"no tokenizer was given, but {' and '.join(needs)} need one: pass tokenizer= (or "
        f"give token ids) ({_HOW_TO_FIX})"
    )
  if _is_transformers_tokenizer(tokenizer) or _is_tokenizers_tokenizer(tokenizer):
    # Their encode adds special tokens (and transformers' chat template returns ids): they
    # have the members' names with other meanings, so they are adapted, never taken as is.
    raise TypeError(
        f"tokenizer {_name(tokenizer)} does not follow kvjax's tokenizer contract as it is: "
        "pass it through kvjax.as_tokenizer"
    )
  problems = []
  seen = set()
  for purpose in needs:
    for member, spelled, needed_for in _NEEDED[purpose]:
      if member in seen:
        continue
      seen.add(member)
      value = getattr(tokenizer, member, _MISSING)
      if value is _MISSING or (member in _CALLABLE and not callable(value)):
        problems.append(f"lacks {spelled}, needed {needed_for}")
      elif member == "decode" and not _takes_skip_special_tokens(value):
        problems.append(
            "has decode(ids) without a skip_special_tokens argument (kvjax calls "
            f"decode(ids, skip_special_tokens=True)), needed {needed_for}"
        )
      elif member == "eos_ids" and not _is_id_collection(value):
        problems.append(
            f"has eos_ids={value!r}, not a tuple of token ids (use () for none), needed "
            f"{needed_for}"
        )
      elif member == "chat_template" and not (value is None or isinstance(value, str)):
        problems.append(f"has chat_template of type {type(value).__name__}, not a str or None")
  if "text" in needs or "chat" in needs:
    bos_id = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos", False) and not (is_int(bos_id) and bos_id >= 0):
      problems.append(
          f"has add_bos true but bos_id={bos_id!r}, not a token id, needed to start a sequence"
      )
  if problems:
    raise TypeError(f"tokenizer {_name(tokenizer)} " + "; ".join(problems) + f" ({_HOW_TO_FIX})")
  if "chat" in needs and tokenizer.chat_template is None:
    raise ValueError(
        f"tokenizer {_name(tokenizer)} has no chat template (chat_template is None: a "
        "base model), needed for chat; read the prompt as plain text (chat=False) or give "
        "the model's template (kvjax.as_tokenizer(..., chat_template=...))"
    )


def _name(tokenizer) -> str:
  """How an error names a tokenizer: by the class the caller passed, not its adapter's."""
  if isinstance(tokenizer, TransformersTokenizer):
    return f"{type(tokenizer.hf_tokenizer).__name__} (transformers)"
  if isinstance(tokenizer, TokenizersTokenizer):
    return "tokenizers.Tokenizer"
  if isinstance(tokenizer, _WithSpecialIds):
    return type(tokenizer._tokenizer).__name__
  if _is_tokenizers_tokenizer(tokenizer):
    return "tokenizers.Tokenizer"
  if _is_transformers_tokenizer(tokenizer):
    return f"{type(tokenizer).__name__} (transformers)"
  return type(tokenizer).__name__


def _check_messages(messages) -> list[dict]:
  if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
    raise TypeError(
        f"apply_chat_template: messages must be a list of dicts, got {type(messages).__name__}"
    )
  for i, m in enumerate(messages):
    if (
        not isinstance(m, Mapping)
        or not isinstance(m.get("role"), str)
        or not isinstance(m.get("content"), str)
    ):
      raise ValueError(
          f"apply_chat_template: messages[{i}] must be a dict with str 'role' and 'content', "
          f"got {m!r}"
      )
  return [dict(m) for m in messages]


def _check_text(text) -> str:
  if not isinstance(text, str):
    raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    raise ValueError(
        f"encode: text is not valid UTF-8: character {err.start} is {text[err.start]!r}"
    ) from None
  return text


def _id_list(ids) -> list[int]:
  return [int(i) for i in ids]  # numpy ints and arrays too: the backends take Python ints


class TokenizersTokenizer:
  """A Hugging Face `tokenizers.Tokenizer` with the kvjax contract: `encode` adds no special
  tokens, special ids and the chat template are what the caller gives (none by default)."""

  def __init__(
      self,
      tok,
      *,
      eos_ids: Iterable[int] = (),
      bos_id: int | None = None,
      add_bos: bool = False,
      chat_template: str | None = None,
  ):
    # Named `tok` as in models.Tokenizer: a saved state fingerprints a tokenizer by
    # `tok.to_str()`, so both spellings of one tokenizer load each other's states.
    self.tok = tok
    self.eos_ids = tuple(eos_ids)
    self.bos_id = bos_id
    self.add_bos = add_bos
    self.chat_template = chat_template
    self._compiled_template = None  # (template source, jinja2 template), compiled on first use

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, no special tokens added."""
    return self.tok.encode(_check_text(text), add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of `ids`."""
    return self.tok.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """Render `messages` with `chat_template` in jinja2's immutable sandbox, with the
    settings transformers and `models.Tokenizer` use (so a template renders the same text).
    The template is the caller's, given to `as_tokenizer`: unlike a model file's in
    `models.Tokenizer`, its render is not bounded in size or time."""
    if self.chat_template is None:
      raise ValueError("apply_chat_template: this tokenizer has no chat template")
    messages = _check_messages(messages)
    if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
      self._compiled_template = (self.chat_template, _compile_template(self.chat_template))
    token = lambda i: "" if i is None else self.tok.id_to_token(i) or ""  # noqa: E731
    try:
      return self._compiled_template[1].render(
          messages=messages,
          add_generation_prompt=add_generation_prompt,
          bos_token=token(self.bos_id),
          eos_token=token(self.eos_ids[0] if self.eos_ids else None),
      )
    except RecursionError:
      raise ValueError(
          f"chat template: its recursion exceeds Python's limit of {sys.getrecursionlimit()}"
      ) from None


def _compile_template(source: str):
  import jinja2.sandbox

  def raise_exception(message):
    raise ValueError(f"chat template: {message}")

  def strftime_now(format):  # Llama 3.1's templates print today's date
    return datetime.datetime.now().strftime(format)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as err:
    raise ValueError(f"chat_template is not a valid jinja2 template: {err}") from None


class TransformersTokenizer:
  """A transformers tokenizer (`PreTrainedTokenizerBase`) with the kvjax contract: `encode`
  adds no special tokens; `add_bos` says whether the tokenizer's own encoding starts with
  BOS; `apply_chat_template` returns text."""

  def __init__(
      self,
      hf_tokenizer,
      *,
      eos_ids: Iterable[int],
      bos_id: int | None,
      add_bos: bool,
      chat_template: str | None,
  ):
    self.hf_tokenizer = hf_tokenizer
    self.eos_ids = tuple(eos_ids)
    self.bos_id = bos_id
    self.add_bos = add_bos
    self.chat_template = chat_template

  @property
  def tok(self):
    """The fast tokenizer's `tokenizers.Tokenizer` (None for a slow one): a saved state
    fingerprints a tokenizer by `tok.to_str()` where it has one, by encoding a probe else."""
    return getattr(self.hf_tokenizer, "backend_tokenizer", None)

  @property
  def vocab_size(self) -> int:
    return len(self.hf_tokenizer)

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, no special tokens added."""
    return list(self.hf_tokenizer.encode(_check_text(text), add_special_tokens=False))

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of `ids`."""
    return self.hf_tokenizer.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """The text transformers renders (`tokenize=False`) with `chat_template`."""
    if self.chat_template is None:
      raise ValueError("apply_chat_template: this tokenizer has no chat template")
    rendered = self.hf_tokenizer.apply_chat_template(
        _check_messages(messages),
        chat_template=self.chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    if not isinstance(rendered, str):
      raise TypeError(
          f"apply_chat_template: transformers returned {type(rendered).__name__}, not text"
      )
    return rendered


class _WithSpecialIds:
  """A tokenizer of the caller's own with some of `eos_ids`, `bos_id`, `add_bos` given to
  `as_tokenizer`; everything else is the tokenizer's."""

  def __init__(self, tokenizer, special: dict):
    self._tokenizer = tokenizer
    self.__dict__.update(special)

  def __getattr__(self, name):  # only names not set in __init__ reach here
    if name == "_tokenizer":  # not set yet (a copy being made): no recursion
      raise AttributeError(name)
    return getattr(self._tokenizer, name)


def _is_transformers_tokenizer(obj) -> bool:
  # By class, not isinstance: transformers is imported only where the object comes from it.
  return any(
      cls.__name__ == "PreTrainedTokenizerBase" and cls.__module__.startswith("transformers.")
      for cls in type(obj).__mro__
  )


def _is_tokenizers_tokenizer(obj) -> bool:
  tokenizers = sys.modules.get("tokenizers")  # loaded wherever such an object exists
  return tokenizers is not None and isinstance(obj, tokenizers.Tokenizer)


def _check_ids(name: str, value, vocab_size: int | None) -> tuple[int, ...]:
  """`value` (an id or an iterable of ids) as a tuple of unique ids, in order."""
  ids = value
  if is_int(value):
    ids = (value,)
  elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
    ids = tuple(value)  # once: a generator is read here and nowhere else
  if not _is_id_collection(ids):
    raise TypeError(f"{name} must be a token id or a collection of token ids, got {value!r}")
  ids = tuple(dict.fromkeys(int(i) for i in ids))
  if vocab_size is not None and any(i >= vocab_size for i in ids):
    raise ValueError(f"{name}={value!r} has ids outside the vocabulary [0, {vocab_size})")
  return ids


def _check_options(vocab_size, eos_ids, bos_id, add_bos, chat_template) -> dict:
  """The options given to `as_tokenizer` (None: not given), checked."""
  given = {}
  if eos_ids is not None:
    given["eos_ids"] = _check_ids("eos_ids", eos_ids, vocab_size)
  if bos_id is not None:
    if not is_int(bos_id):
      raise TypeError(f"bos_id must be a token id (an int), got {bos_id!r}")
    given["bos_id"] = _check_ids("bos_id", bos_id, vocab_size)[0]
  if add_bos is not None and not isinstance(add_bos, bool):
    raise TypeError(f"add_bos must be True, False or None, got {add_bos!r}")
  if add_bos is not None:
    given["add_bos"] = add_bos
  if chat_template is not None and not isinstance(chat_template, str):
    raise TypeError(f"chat_template must be a str, got {type(chat_template).__name__}")
  if chat_template is not None:
    given["chat_template"] = chat_template
  return given


def _generation_eos_ids(generation_config) -> list[int]:
  """The EOS ids of a generation config: a transformers `GenerationConfig` (or any object
  with `eos_token_id`) or a mapping (generation_config.json's contents)."""
  if isinstance(generation_config, Mapping):
    value = generation_config.get("eos_token_id")
  elif hasattr(generation_config, "eos_token_id"):
    value = generation_config.eos_token_id
  else:
    raise TypeError(
        "generation_config must be a mapping or an object with eos_token_id (a transformers "
        f"GenerationConfig), got {type(generation_config).__name__}"
    )
  if value is None:
    return []
  return list(_check_ids("generation_config's eos_token_id", value, None))


def _transformers_adapter(hf, options: dict, generation_config) -> TransformersTokenizer:
  eos = hf.eos_token_id
  eos_ids = [] if eos is None else list(_check_ids("the tokenizer's eos_token_id", eos, None))
  if generation_config is not None:
    # generation_config.json may end generation at more ids than the tokenizer's EOS
    # (Llama 3's <|eot_id|> and <|eom_id|>).
    eos_ids += _generation_eos_ids(generation_config)
  bos_id = options.get("bos_id", hf.bos_token_id)
  if "add_bos" in options:
    add_bos = options["add_bos"]
  else:
    # What the tokenizer does, not a flag: transformers 5's add_bos_token is False for a
    # tokenizer.json whose post-processor adds BOS (Llama 3's).
    probe = "Hello"
    with_specials = list(hf.encode(probe, add_special_tokens=True))
    add_bos = (
        bos_id is not None
        and with_specials[:1] == [bos_id]
        and list(hf.encode(probe, add_special_tokens=False))[:1] != [bos_id]
    )
  chat_template = options.get("chat_template", getattr(hf, "chat_template", None))
  if isinstance(chat_template, Mapping):  # named templates: the default one is the chat's
    chat_template = chat_template.get("default")
  return TransformersTokenizer(
      hf,
      eos_ids=options.get("eos_ids", tuple(dict.fromkeys(eos_ids))),
      bos_id=bos_id,
      add_bos=add_bos,
      chat_template=chat_template,
  )


def as_tokenizer(
    tokenizer: Any,
    *,
    needs: Iterable[str] | str = _DEFAULT_NEEDS,
    eos_ids: int | Iterable[int] | None = None,
    bos_id: int | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
    generation_config: Any = None,
) -> TokenizerLike:
  """A tokenizer with kvjax's contract (`TokenizerLike`), checked for `needs`.

  - A Hugging Face `tokenizers.Tokenizer` is wrapped (`TokenizersTokenizer`): `encode` adds
    no special tokens; EOS ids, BOS and chat template are the ones given here (none by
    default: such a tokenizer does not know them).
  - A transformers tokenizer (`PreTrainedTokenizerBase`) is wrapped
    (`TransformersTokenizer`): EOS ids from its `eos_token_id` and `generation_config`'s,
    `bos_id` from `bos_token_id`, `add_bos` where its own encoding starts with BOS, its
    chat template; what is given here replaces them.
  - Anything else is taken as a tokenizer of the caller's own and returned as it is (or,
    with `eos_ids`, `bos_id` or `add_bos` given, with those replaced); so is one this
    function returned.

  Args:
    tokenizer: the tokenizer.
    needs: what it must do, among `PURPOSES` ("text", "chat", "decode", "stop"): by default
      what `kvjax.generate` of text prompts calls. See `check_tokenizer`.
    eos_ids: the ids that end generation (an int or several); `()` for none.
    bos_id: the beginning-of-sequence id.
    add_bos: whether a sequence starts with `bos_id` (None: the tokenizer's own behaviour;
      False for a `tokenizers.Tokenizer`).
    chat_template: the jinja2 chat template (not for a tokenizer of the caller's own, whose
      `apply_chat_template` renders its own).
    generation_config: a transformers `GenerationConfig` or generation_config.json's
      contents, whose `eos_token_id` adds EOS ids (transformers tokenizers only).

  Raises:
    TypeError: `tokenizer` lacks what `needs` calls for (one error naming every member
      missing, and what it is needed for), or an option of the wrong type.
    ValueError: an id outside the vocabulary, `add_bos` without `bos_id`, or "chat" needed
      from a tokenizer without a chat template.
  """
  needs = _purposes(needs)
  if tokenizer is None:
    raise TypeError(
        "as_tokenizer: tokenizer is None; pass a tokenizer, or give prompts as token ids "
        "without one"
    )
  if _is_transformers_tokenizer(tokenizer):
    options = _check_options(len(tokenizer), eos_ids, bos_id, add_bos, chat_template)
    adapted = _transformers_adapter(tokenizer, options, generation_config)
  elif generation_config is not None:
    raise ValueError(
        "as_tokenizer: generation_config is read for a transformers tokenizer only; give "
        f"eos_ids= for a {type(tokenizer).__name__}"
    )
  elif _is_tokenizers_tokenizer(tokenizer):
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    adapted = TokenizersTokenizer(
        tokenizer, **_check_options(vocab_size, eos_ids, bos_id, add_bos, chat_template)
    )
  elif chat_template is not None:
    raise ValueError(
        f"as_tokenizer: chat_template= is for a tokenizers.Tokenizer or a transformers "
        f"tokenizer; a {type(tokenizer).__name__} renders chats with its own "
        "apply_chat_template (set its chat_template)"
    )
  else:
    special = _check_options(None, eos_ids, bos_id, add_bos, None)
    adapted = _WithSpecialIds(tokenizer, special) if special else tokenizer
  if add_bos and getattr(adapted, "bos_id", None) is None:
    raise ValueError("as_tokenizer: add_bos=True needs a bos_id (give bos_id=)")
  check_tokenizer(adapted, needs)
  return adapted


def tokenizer_for(tokenizer, needs: Iterable[str]) -> TokenizerLike | None:
  """What an entry point (`generate`, `prefill`, `ask`) uses: `as_tokenizer(tokenizer,
  needs=needs)`, or None where none was given and none is needed (token-id prompts); a
  TypeError naming what is missing otherwise."""
  needs = _purposes(needs)
  if tokenizer is None:
    check_tokenizer(None, needs)
    return None
  return as_tokenizer(tokenizer, needs=needs)
