"""The tokenizer contract (`kvjax.runtime.tokenizer`): a tokenizer of the caller's own passes
as it is, a `tokenizers.Tokenizer` and a transformers tokenizer are adapted to give the same
ids, chat text, EOS ids and decoded text as the project's tokenizer for SmolLM2, and one
missing a member is refused in one TypeError naming it and what it is needed for."""

import json
import os
import re
import sys

import pytest
import tokenizers

import kvjax
from kvjax.persistence._format import tokenizer_fingerprint
from kvjax.runtime.tokenizer import (
    PURPOSES,
    TokenizersTokenizer,
    TransformersTokenizer,
    as_tokenizer,
    check_tokenizer,
)
from kvjax.testing import ByteTokenizer, tiny_llama
from models.registry import resolve_model
from models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  two spaces, a tab\tand a newline\n",
    "naïve café 日本語 🙂 0123456789",
    "<|im_start|>user\nHi<|im_end|>",  # special tokens in text match whole, as kvjax reads them
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <b> there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ],
]
SMOL_BOS, SMOL_EOS = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
  """The project's SmolLM2 tokenizer (the reference the adapters must agree with)."""
  return Tokenizer.from_gguf(resolve_model().path)


def _backend(smol: Tokenizer) -> tokenizers.Tokenizer:
  """A copy of its `tokenizers.Tokenizer`, so no test changes the shared one."""
  return tokenizers.Tokenizer.from_str(smol.tok.to_str())


@pytest.fixture(scope="module")
def hf_fast(smol):
  """A transformers tokenizer built from the same `tokenizers.Tokenizer`, with SmolLM2's
  special tokens and chat template."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=_backend(smol), bos_token=SMOL_BOS, eos_token=SMOL_EOS
  )
  hf.chat_template = smol.chat_template
  return hf


@pytest.fixture(scope="module")
def hf_auto(smol, tmp_path_factory):
  """The same tokenizer as `AutoTokenizer` loads it from a directory (nothing downloaded)."""
  transformers = pytest.importorskip("transformers")
  path = tmp_path_factory.mktemp("smollm2-tokenizer")
  smol.tok.save(str(path / "tokenizer.json"))
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": SMOL_BOS,
      "eos_token": SMOL_EOS,
      "chat_template": smol.chat_template,
  }
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  offline = os.environ.get("HF_HUB_OFFLINE")
  os.environ["HF_HUB_OFFLINE"] = "1"
  try:
    return transformers.AutoTokenizer.from_pretrained(str(path))
  finally:
    if offline is None:
      del os.environ["HF_HUB_OFFLINE"]
    else:
      os.environ["HF_HUB_OFFLINE"] = offline


class OwnTokenizer:
  """A tokenizer of the caller's own, with every member of the contract."""

  eos_ids = (2,)
  bos_id = 1
  add_bos = False
  chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"

  def encode(self, text):
    return [ord(c) % 250 + 3 for c in text]

  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(i - 3) for i in ids if i >= 3)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "".join(f"[{m['role']}] {m['content']}\n" for m in messages)


def _without(member: str):
  """An `OwnTokenizer` whose class lacks `member`."""
  namespace = {k: v for k, v in vars(OwnTokenizer).items() if k != member}
  return type("PartialTokenizer", (), namespace)()


def _with(**members):
  """An `OwnTokenizer` with `members` replaced."""
  return type("OddTokenizer", (OwnTokenizer,), members)()


# A tokenizer of the caller's own.


def test_a_tokenizer_of_the_contract_is_returned_as_it_is(smol):
  for tokenizer in (OwnTokenizer(), ByteTokenizer(), smol):
    assert as_tokenizer(tokenizer, needs=PURPOSES if tokenizer.chat_template else ()) is tokenizer
  assert as_tokenizer(ByteTokenizer()) is not None  # encode, decode, eos_ids: generate's needs
  adapted = as_tokenizer(smol.tok)
  assert as_tokenizer(adapted) is adapted  # an adapter follows the contract itself


def test_special_ids_given_for_an_own_tokenizer_replace_its_own_and_keep_the_rest():
  tokenizer = as_tokenizer(_without("eos_ids"), eos_ids=[7, 9, 7], bos_id=4, add_bos=True)
  assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((7, 9), 4, True)
  assert tokenizer.encode("ab") == OwnTokenizer().encode("ab")
  assert tokenizer.chat_template == OwnTokenizer.chat_template
  check_tokenizer(tokenizer, PURPOSES)


# What is missing, named.

MEMBERS = {  # what each purpose calls
    "text": {"encode"},
    "chat": {"encode", "chat_template", "apply_chat_template"},
    "decode": {"decode"},
    "stop": {"eos_ids"},
}
MISSING = [
    ("encode", "text", "lacks encode(text) -> list[int], needed to encode text prompts"),
    ("decode", "decode", "lacks decode(ids, skip_special_tokens=...) -> str, needed to return"),
    ("eos_ids", "stop", "lacks eos_ids (a tuple of token ids that end generation), needed to"),
    ("chat_template", "chat", "lacks chat_template (a str, or None for a base model), needed"),
    ("apply_chat_template", "chat", "lacks apply_chat_template(messages, add_generation_prompt="),
    ("encode", "chat", "lacks encode(text) -> list[int]"),
]


@pytest.mark.parametrize("member, purpose, message", MISSING)
def test_a_missing_member_is_one_type_error_naming_it_and_its_use(member, purpose, message):
  with pytest.raises(TypeError, match="PartialTokenizer") as raised:
    as_tokenizer(_without(member), needs=purpose)
  assert message in str(raised.value)
  assert "kvjax.as_tokenizer" in str(raised.value)  # and what to do about it
  # Purposes that do not call the member do not ask for it.
  check_tokenizer(_without(member), [p for p in PURPOSES if member not in MEMBERS[p]])


def test_everything_missing_is_named_in_one_error():
  with pytest.raises(TypeError) as raised:
    as_tokenizer(object())  # generate's needs: text, decode, stop
  message = str(raised.value)
  assert message.startswith("tokenizer object lacks encode(text)")
  for part in ("needed to encode text prompts", "needed to return text", "needed to stop at EOS"):
    assert part in message


@pytest.mark.parametrize(
    "members, purpose, message",
    [
        ({"decode": lambda self, ids: ""}, "decode", "has decode(ids) without a skip_special"),
        ({"eos_ids": 2}, "stop", "has eos_ids=2, not a tuple of token ids"),
        ({"eos_ids": ["</s>"]}, "stop", "has eos_ids=['</s>'], not a tuple of token ids"),
        ({"encode": "not a method"}, "text", "lacks encode(text)"),
        ({"chat_template": b"{{ x }}"}, "chat", "has chat_template of type bytes"),
        ({"add_bos": True, "bos_id": None}, "text", "has add_bos true but bos_id=None"),
    ],
)
def test_a_member_of_the_wrong_kind_is_named(members, purpose, message):
  with pytest.raises(TypeError, match="OddTokenizer") as raised:
    check_tokenizer(_with(**members), purpose)
  assert message in str(raised.value)


def test_a_decode_taking_any_keyword_is_accepted():
  check_tokenizer(_with(decode=lambda self, ids, **options: ""), "decode")


def test_chat_without_a_template_is_a_value_error_saying_so(smol):
  with pytest.raises(ValueError, match="has no chat template .* needed for chat"):
    as_tokenizer(_with(chat_template=None), needs="chat")
  with pytest.raises(ValueError, match="tokenizers.Tokenizer has no chat template"):
    as_tokenizer(smol.tok, needs="chat")
  as_tokenizer(_with(chat_template=None))  # generate of plain text needs none


def test_needs_and_the_options_are_checked_and_named(smol):
  with pytest.raises(ValueError, match="needs: unknown purpose.*'txt'"):
    as_tokenizer(OwnTokenizer(), needs=["txt"])
  with pytest.raises(TypeError, match="as_tokenizer: tokenizer is None"):
    as_tokenizer(None)
  with pytest.raises(TypeError, match="no tokenizer was given, but text and chat need one"):
    check_tokenizer(None, ["text", "chat"])
  check_tokenizer(None, ())  # token-id prompts, nothing decoded: none is needed
  with pytest.raises(ValueError, match=r"eos_ids=\[2, 49152\] has ids outside .*49152"):
    as_tokenizer(smol.tok, eos_ids=[2, 49152])
  with pytest.raises(TypeError, match="eos_ids must be a token id or a collection"):
    as_tokenizer(smol.tok, eos_ids="<|im_end|>")
  with pytest.raises(TypeError, match="bos_id must be a token id"):
    as_tokenizer(smol.tok, bos_id=1.0)
  with pytest.raises(TypeError, match="add_bos must be True, False or None"):
    as_tokenizer(smol.tok, add_bos=1)
  with pytest.raises(ValueError, match="add_bos=True needs a bos_id"):
    as_tokenizer(smol.tok, add_bos=True)
  with pytest.raises(TypeError, match="chat_template must be a str"):
    as_tokenizer(smol.tok, chat_template=b"{{ x }}")
  with pytest.raises(ValueError, match="chat_template is not a valid jinja2 template"):
    as_tokenizer(smol.tok, chat_template="{% for %}").apply_chat_template(CHATS[0])
  with pytest.raises(ValueError, match="chat_template= is for a tokenizers.Tokenizer"):
    as_tokenizer(OwnTokenizer(), chat_template="{{ messages }}")
  with pytest.raises(ValueError, match="generation_config is read for a transformers"):
    as_tokenizer(smol.tok, generation_config={"eos_token_id": 2})


def test_a_library_tokenizer_is_not_taken_as_it_is(smol, hf_fast):
  for tokenizer, name in ((smol.tok, "tokenizers.Tokenizer"), (hf_fast, "(transformers)")):
    with pytest.raises(TypeError, match=re.escape(name) + " does not follow .*as_tokenizer"):
      check_tokenizer(tokenizer, "text")


# A tokenizers.Tokenizer.


def test_a_tokenizers_tokenizer_gives_the_projects_ids_text_and_chat(smol, monkeypatch):
  monkeypatch.delitem(sys.modules, "transformers", raising=False)
  tokenizer = as_tokenizer(
      _backend(smol), eos_ids=smol.eos_ids, bos_id=smol.bos_id, chat_template=smol.chat_template
  )
  assert "transformers" not in sys.modules  # adapting one imports nothing it does not need
  assert isinstance(tokenizer, TokenizersTokenizer)
  assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((2,), 1, False)
  for text in TEXTS:
    ids = tokenizer.encode(text)
    assert ids == smol.encode(text)
    assert tokenizer.decode(ids) == smol.decode(ids)
  assert tokenizer.decode(smol.encode(TEXTS[2])) == TEXTS[2]
  assert tokenizer.decode(smol.encode(TEXTS[3]), skip_special_tokens=True) == "user\nHi"
  for chat in CHATS:
    for generation_prompt in (True, False):
      assert tokenizer.apply_chat_template(chat, generation_prompt) == smol.apply_chat_template(
          chat, generation_prompt
      )
  assert tokenizer.vocab_size == smol.vocab_size
  # A state saved with one loads with the other: their fingerprints agree.
  assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(smol)


def test_a_tokenizers_tokenizer_alone_knows_no_special_ids_or_template(smol):
  tokenizer = as_tokenizer(_backend(smol))
  assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((), None, False)
  assert tokenizer.chat_template is None
  assert tokenizer.encode("<|im_start|>x") == smol.encode("<|im_start|>x")
  with pytest.raises(ValueError, match="messages\\[0\\] must be a dict with str 'role'"):
    as_tokenizer(_backend(smol), chat_template="{{ messages }}").apply_chat_template([{"role": 1}])
  with pytest.raises(TypeError, match="encode: text must be a str, got bytes"):
    tokenizer.encode(b"x")
  with pytest.raises(ValueError, match="encode: text is not valid UTF-8"):
    tokenizer.encode("\udcff")


# A transformers tokenizer.


# AutoTokenizer imports torch (seconds): the directory's case runs in the slow set.
@pytest.mark.parametrize("which", ["hf_fast", pytest.param("hf_auto", marks=pytest.mark.slow)])
def test_a_transformers_tokenizer_gives_the_projects_ids_text_and_chat(smol, which, request):
  hf = request.getfixturevalue(which)
  tokenizer = as_tokenizer(hf, needs=PURPOSES)
  assert isinstance(tokenizer, TransformersTokenizer)
  assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((2,), 1, False)
  assert tokenizer.chat_template == smol.chat_template
  for text in TEXTS:
    ids = tokenizer.encode(text)
    assert ids == smol.encode(text)
    for skip in (True, False):
      assert tokenizer.decode(ids, skip_special_tokens=skip) == smol.decode(ids, skip)
  assert tokenizer.decode(smol.encode(TEXTS[3]), skip_special_tokens=True) == "user\nHi"
  for chat in CHATS:
    for generation_prompt in (True, False):
      rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt)
      assert rendered == smol.apply_chat_template(chat, generation_prompt)
  assert tokenizer.vocab_size == len(hf)
  assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(as_tokenizer(hf))


def test_a_transformers_tokenizer_that_adds_bos_says_so_and_encode_still_adds_nothing(smol):
  transformers = pytest.importorskip("transformers")
  flagged = transformers.PreTrainedTokenizerFast(
      tokenizer_object=_backend(smol), bos_token=SMOL_BOS, eos_token=SMOL_EOS, add_bos_token=True
  )
  # Llama 3's way: the tokenizer.json's post-processor adds BOS, and add_bos_token is False.
  backend = _backend(smol)
  backend.post_processor = tokenizers.processors.TemplateProcessing(
      single=f"{SMOL_BOS} $A", special_tokens=[(SMOL_BOS, smol.bos_id)]
  )
  post_processed = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token=SMOL_BOS, eos_token=SMOL_EOS
  )
  for hf in (flagged, post_processed):
    assert hf.encode("Hello")[0] == smol.bos_id
    tokenizer = as_tokenizer(hf)
    assert (tokenizer.add_bos, tokenizer.bos_id) == (True, smol.bos_id)
    assert tokenizer.encode("Hello") == smol.encode("Hello")
    assert not as_tokenizer(hf, add_bos=False).add_bos


def test_a_transformers_tokenizer_takes_eos_ids_from_a_generation_config(smol, hf_fast):
  transformers = pytest.importorskip("transformers")
  stop = transformers.GenerationConfig(eos_token_id=[2, 0])
  assert as_tokenizer(hf_fast, generation_config=stop).eos_ids == (2, 0)
  assert as_tokenizer(hf_fast, generation_config={"eos_token_id": 5}).eos_ids == (2, 5)
  assert as_tokenizer(hf_fast, generation_config={}).eos_ids == (2,)
  assert as_tokenizer(hf_fast, eos_ids=7, generation_config=stop).eos_ids == (7,)  # given wins
  with pytest.raises(TypeError, match="generation_config must be a mapping or an object"):
    as_tokenizer(hf_fast, generation_config=[2])


def test_a_transformers_tokenizer_without_eos_or_template(smol):
  transformers = pytest.importorskip("transformers")
  bare = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(smol))
  tokenizer = as_tokenizer(bare)
  assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.add_bos) == ((), None, False)
  assert tokenizer.chat_template is None
  with pytest.raises(ValueError, match=r"PreTrainedTokenizerFast|TokenizersBackend"):
    as_tokenizer(bare, needs="chat")
  given = as_tokenizer(bare, chat_template=smol.chat_template, eos_ids=[2])
  assert given.apply_chat_template(CHATS[1]) == smol.apply_chat_template(CHATS[1])


# End to end: the same generation as with the project's tokenizer.


def test_generate_with_a_transformers_tokenizer_matches_the_projects(smol, hf_fast):
  model = tiny_llama(vocab_size=smol.vocab_size, max_context=128)
  prompts = ["The capital of France is"]
  options = {"max_new_tokens": 6, "chat": True}
  ours = kvjax.generate(model, smol, prompts, **options)
  theirs = kvjax.generate(model, as_tokenizer(hf_fast, needs=PURPOSES), prompts, **options)
  assert theirs.tokens == ours.tokens
  assert theirs.texts == ours.texts
  assert theirs.finish_reasons == ours.finish_reasons
