"""Tokenizers (via `tokenizers`) from GGUF metadata -- byte-level BPE ("gpt2") or SentencePiece
BPE ("llama") vocabularies -- or from a tokenizer.json."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from ._template_sandbox import RenderBudget, bounded_sandbox_class

# Split regexes of llama.cpp's `tokenizer.ggml.pre` families (the same as in the HF tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")  # GPT-2 regex after isolating every digit
SUPPORTED_PRE = (*_DIGIT_SPLIT_PRES, "gpt-2", "llama-bpe", "qwen2")

# GGUF token types (llama.cpp `llama_token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SP_SPACE = "\u2581"  # SentencePiece's spelling of a space ("▁")
# SentencePiece files without merges get them rebuilt from the vocabulary, best first. For these
# architectures the rank is the token order in the file, not `tokenizer.ggml.scores`: llama.cpp
# scores Gemma's user-defined pieces ("\n\n", runs of spaces, HTML tags) -1000, which would put
# e.g. "▁▁" after ~1500 ordinary pieces, while Gemma applies them first. general.architecture is
# what tells them apart (as in transformers' gguf `gemma_tokenizer`); every other file (Llama 2,
# Mistral, ...) ranks by score.
_FILE_ORDER_ARCHS = ("gemma", "gemma2", "gemma3")


def _pre_tokenizer(pre: str):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  if pre in _DIGIT_SPLIT_PRES:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
  if pre == "gpt-2":
    return pre_tokenizers.ByteLevel(add_prefix_space=False)
  split = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
  if split is None:
    raise ValueError(
        f"tokenizer.ggml.pre={pre!r} is not supported " f"(supported: {', '.join(SUPPORTED_PRE)})"
    )
  return pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
  )


def _add_file_specials(tok: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]):
  """Add the file's control tokens as special tokens and its user-defined ones as plain added
  tokens, both at their own ids."""
  # They must match whole in raw text, e.g. <|im_start|> -> one id, as llama.cpp matches them.
  tok.add_special_tokens(
      [
          AddedToken(t, special=True, normalized=False)
          for t, ty in zip(tokens, types)
          if ty == _CONTROL
      ]
  )
  tok.add_tokens(
      [
          AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types)
          if ty == _USER_DEFINED
      ]
  )


def _byte_level_tokenizer(md: Mapping[str, Any], tokens: list[str], types: list[int]):
  """The `tokenizers.Tokenizer` of a byte-level BPE ("gpt2") GGUF vocabulary."""
  if "tokenizer.ggml.merges" not in md:
    raise ValueError("GGUF metadata lacks 'tokenizer.ggml.merges'; cannot rebuild the tokenizer")
  pre = md.get("tokenizer.ggml.pre", "gpt-2")
  # Byte-level vocabularies spell every byte as a printable char, so no token contains a
  # space and each merge "a b" splits unambiguously.
  merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
  bpe = models.BPE(
      vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=pre == "llama-bpe"
  )  # as in Llama-3's tokenizer.json
  tok = tokenizers.Tokenizer(bpe)
  if pre == "qwen2":
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = _pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  _add_file_specials(tok, tokens, types)
  return tok


def _sentencepiece_merges(
    tokens: Sequence[str], priority: Sequence[float]
) -> list[tuple[str, str]]:
  """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens,
  best first by the token's `priority` (higher first), then by longer left and right pieces,
  then by file order -- the order transformers' `generate_merges` gives (so ids agree)."""
  index = {t: i for i, t in enumerate(tokens)}
  rank = dict(zip(tokens, priority))  # a repeated token keeps its first place, last priority
  found = [
      (p, t[:i], t[i:])
      for t, p in rank.items()
      for i in range(len(t) - 1, 0, -1)  # longer left piece first
      if t[:i] in index and t[i:] in index
  ]
  # Stable, so equal keys keep file order; within one token `i` already orders the splits.
  found.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
  return [(left, right) for _, left, right in found]


def _sentencepiece_tokenizer(md: Mapping[str, Any], tokens: list[str], types: list[int]):
  """The `tokenizers.Tokenizer` of a SentencePiece BPE ("llama") GGUF vocabulary (Llama 2,
  Gemma 3): BPE over the pieces with byte fallback to the <0xNN> pieces."""
  known = set(tokens)
  # Byte fallback finds the byte pieces by name, as llama.cpp does.
  if not any(f"<0x{b:02X}>" in known for b in range(256)):
    # Without them text outside the vocabulary would be lost; a byte-level vocabulary
    # labelled "llama" ends up here too.
    raise ValueError(
        "GGUF tokenizer.ggml.model='llama' needs the byte pieces <0x00>..<0xFF> (token_type "
        f"{_BYTE}) in tokenizer.ggml.tokens; this vocabulary has none"
    )
  # llama.cpp's converter stores user-defined runs of spaces with real spaces (it matches them
  # in raw text); the normalizer below turns every space into "▁" first, so only the "▁"
  # spelling can match.
  pieces = [
      _SP_SPACE * len(t)
      if len(t) > 1 and t == " " * len(t) and _SP_SPACE * len(t) not in known
      else t
      for t in tokens
  ]
  if "tokenizer.ggml.merges" in md:
    merges = []
    for m in md["tokenizer.ggml.merges"]:
      pair = tuple(m.split(" "))
      if len(pair) != 2:
        raise ValueError(f"GGUF tokenizer.ggml.merges has a malformed entry {m!r}")
      merges.append(pair)
  elif md.get("general.architecture") in _FILE_ORDER_ARCHS:
    merges = _sentencepiece_merges(pieces, range(0, -len(pieces), -1))
  elif "tokenizer.ggml.scores" in md:
    merges = _sentencepiece_merges(pieces, list(md["tokenizer.ggml.scores"]))
  else:
    raise ValueError(
        "GGUF metadata lacks both 'tokenizer.ggml.merges' and 'tokenizer.ggml.scores'; cannot "
        "rebuild the SentencePiece merges"
    )
  unk_id = md.get("tokenizer.ggml.unknown_token_id")
  if unk_id is not None and not 0 <= unk_id < len(pieces):
    raise ValueError(f"GGUF tokenizer.ggml.unknown_token_id={unk_id} is not a token id")
  try:
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(pieces)},
        merges=merges,
        unk_token=None if unk_id is None else pieces[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )
  except Exception as e:  # tokenizers raises a bare Exception on a merge outside the vocab
    raise ValueError(f"GGUF tokenizer.ggml.merges does not fit tokenizer.ggml.tokens: {e}") from e
  tok = tokenizers.Tokenizer(bpe)
  # llama.cpp's default for SentencePiece is a prefix space; Gemma's files turn it off.
  prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
  replace = normalizers.Replace(" ", _SP_SPACE)
  # Normalized per stretch of text between added tokens: after a control token the prefix
  # comes back, as in llama.cpp.
  tok.normalizer = (
      normalizers.Sequence([normalizers.Prepend(_SP_SPACE), replace]) if prefix else replace
  )
  steps = [decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if prefix:
    steps.append(decoders.Strip(" ", 1, 0))  # the space the normalizer put first
  tok.decoder = decoders.Sequence(steps)
  # The unknown piece matches whole like a control one (llama.cpp and transformers both do);
  # the respelled space runs are reached through merges of "▁" instead (their file spelling
  # is not a piece any more; transformers leaves them out too).
  roles = [
      _CONTROL if ty == _UNKNOWN else _NORMAL if p != t else ty
      for t, p, ty in zip(tokens, pieces, types)
  ]
  _add_file_specials(tok, pieces, roles)
  return tok


class Tokenizer:
  """Text <-> ids, plus the model's chat template and special ids."""

  def __init__(
      self,
      tok: tokenizers.Tokenizer,
      *,
      bos_id: int | None = None,
      eos_ids: Sequence[int] = (),
      chat_template: str | None = None,
      add_bos: bool = False,
  ):
    """`add_bos`: whether a sequence starts with `bos_id` (a GGUF's
    tokenizer.ggml.add_bos_token for SentencePiece vocabularies); read by whoever starts one."""
    if add_bos and bos_id is None:
      raise ValueError("Tokenizer(add_bos=True) needs a bos_id")
    self.tok = tok
    self.bos_id = bos_id
    self.eos_ids = tuple(eos_ids)
    self.chat_template = chat_template
    self.add_bos = add_bos

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  @classmethod
  def from_gguf(cls, source: str | os.PathLike | Mapping[str, Any] | Any) -> Tokenizer:
    """Rebuild from GGUF metadata (a .gguf path, a `GGUFReader`, or `load_gguf`'s metadata) of
    a byte-level BPE ("gpt2") or SentencePiece BPE ("llama") vocabulary."""
    from .gguf_loader import gguf_eos_ids, open_gguf, read_metadata

    if isinstance(source, (str, os.PathLike)):
      md = read_metadata(open_gguf(source))
    elif isinstance(source, Mapping):
      md = source
    else:  # a GGUFReader
      md = read_metadata(source)
    kind = md.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
      raise ValueError(
          f"GGUF tokenizer.ggml.model={kind!r} is not supported "
          "(only byte-level BPE, 'gpt2', and SentencePiece BPE, 'llama')"
      )
    if "tokenizer.ggml.tokens" not in md:
      raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens'; cannot rebuild the tokenizer")
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
      raise ValueError(
          f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
      )
    bos_id = md.get("tokenizer.ggml.bos_token_id")
    if kind == "gpt2":
      tok = _byte_level_tokenizer(md, tokens, types)
      add_bos = False  # as before: byte-level files get BOS only when encode is asked for it
    else:
      tok = _sentencepiece_tokenizer(md, tokens, types)
      # llama.cpp adds BOS to SentencePiece text unless the file says otherwise.
      add_bos = bool(md.get("tokenizer.ggml.add_bos_token", True))
      if add_bos and bos_id is None:
        if "tokenizer.ggml.add_bos_token" in md:
          raise ValueError(
              "GGUF tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is "
              "missing"
          )
        add_bos = False
    return cls(
        tok,
        bos_id=bos_id,
        eos_ids=gguf_eos_ids(md),
        chat_template=md.get("tokenizer.chat_template"),
        add_bos=add_bos,
    )

  @classmethod
  def from_json(
      cls,
      text: str,
      *,
      bos_id: int | None = None,
      eos_ids: Sequence[int] = (),
      chat_template: str | None = None,
      add_bos: bool = False,
  ) -> Tokenizer:
    """A tokenizer from its serialised `tokenizers` JSON (`self.tok.to_str()`)."""
    return cls(
        tokenizers.Tokenizer.from_str(text),
        bos_id=bos_id,
        eos_ids=eos_ids,
        chat_template=chat_template,
        add_bos=add_bos,
    )

  @classmethod
  def from_file(
      cls,
      path: str | os.PathLike,
      *,
      bos_id: int | None = None,
      eos_ids: Sequence[int] | None = None,
      chat_template: str | None = None,
  ) -> Tokenizer:
    """Load a tokenizer.json; special ids and chat template default to the sibling
    tokenizer_config.json / chat_template.jinja when present."""
    from .safetensors_loader import read_chat_template, read_json

    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"tokenizer file not found: {str(path)!r}")
    try:
      tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise ValueError(f"{str(path)!r} is not a valid tokenizer.json: {e}") from e
    cfg_path = path.parent / "tokenizer_config.json"
    cfg = read_json(cfg_path) if cfg_path.is_file() else {}

    def token_id(key):
      t = cfg.get(key)
      t = t.get("content") if isinstance(t, dict) else t
      return None if t is None else tok.token_to_id(t)

    if bos_id is None:
      bos_id = token_id("bos_token")
    if eos_ids is None:
      eos = token_id("eos_token")
      eos_ids = () if eos is None else (eos,)
    if chat_template is None:
      chat_template = read_chat_template(path.parent)
    return cls(tok, bos_id=bos_id, eos_ids=eos_ids, chat_template=chat_template)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """The ids of `text`, with `bos_id` first if `add_bos`. Pieces of one prompt are
    encoded apart and joined, so nothing is added by default; whoever starts a sequence
    asks `self.add_bos` (the file's flag) whether it begins with BOS (`kvjax` does at a
    prompt's start, unless the chat template wrote it)."""
    if not isinstance(text, str):
      raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as err:
      raise ValueError(
          f"encode: text is not valid UTF-8: character {err.start} is {text[err.start]!r}"
      ) from None
    ids = self.tok.encode(text, add_special_tokens=False).ids
    if add_bos:
      if self.bos_id is None:
        raise ValueError("encode(add_bos=True): this tokenizer has no bos_id")
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template, in
    jinja2's immutable sandbox with bounds on what the render may make and take (sizes,
    steps, time: `models._template_sandbox`); a template over one raises
    ValueError("chat template: ... exceeds ...")."""
    if self.chat_template is None:
      raise ValueError("apply_chat_template: this tokenizer has no chat template")
    for i, m in enumerate(messages):
      if (
          not isinstance(m, Mapping)
          or not isinstance(m.get("role"), str)
          or not isinstance(m.get("content"), str)
      ):
        raise ValueError(
            f"apply_chat_template: messages[{i}] must be a dict with str "
            f"'role' and 'content', got {m!r}"
        )
    try:
      import jinja2.sandbox  # noqa: F401
    except ImportError:
      return self._chatml_fallback(messages, add_generation_prompt)

    def raise_exception(msg):
      raise ValueError(f"chat template: {msg}")

    special = lambda i: None if i is None else self.tok.id_to_token(i)  # noqa: E731
    bos, eos = special(self.bos_id) or "", special(self.eos_ids[0] if self.eos_ids else None) or ""
    input_chars = len(bos) + len(eos) + sum(len(m["role"]) + len(m["content"]) for m in messages)
    # Same environment settings as transformers, so templates render identically; every
    # step of the render is charged to one budget (the template is the model's, not ours).
    env = bounded_sandbox_class()(
        RenderBudget(input_chars, len(messages)),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
    )
    env.globals["raise_exception"] = raise_exception
    try:
      return env.compile_bounded(self.chat_template).render(
          messages=[dict(m) for m in messages],
          add_generation_prompt=add_generation_prompt,
          bos_token=bos,
          eos_token=eos,
      )
    except RecursionError:  # a macro calling itself, or a template nested too deep to parse
      raise ValueError(
          f"chat template: its recursion exceeds Python's limit of {sys.getrecursionlimit()} "
          "frames"
      ) from None

  def _chatml_fallback(self, messages, add_generation_prompt: bool) -> str:
    if "<|im_start|>" not in self.chat_template:
      raise ImportError(
          "apply_chat_template needs jinja2 for this (non-ChatML) template: " "pip install jinja2"
      )
    warnings.warn(
        "jinja2 is not installed: rendering plain ChatML instead of the model's "
        "template (extras such as a default system prompt are left out); "
        "pip install jinja2 for exact output",
        RuntimeWarning,
        stacklevel=3,
    )
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")
