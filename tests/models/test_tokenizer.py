import json
import sys

import pytest

from models.gguf_loader import open_gguf, read_metadata
from models.registry import DEFAULT_MODEL, resolve_model
from models.tokenizer import Tokenizer

# Reference ids from SmolLM2's HF tokenizer (transformers + its tokenizer.json pre-tokenizer:
# Digits(individual) -> ByteLevel).
KNOWN = {
    "Hello world!": [19556, 905, 17],
    "The year 2024 had 366 days.": [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30],
    # Whitespace before a digit: the digit split keeps "\n\n   " whole (plain GPT-2 would not).
    "Introduction\n\n   1. Hacker": [7479, 1004, 33, 30, 28290, 259],
    "<|im_start|>user\nHi!<|im_end|>\n": [1, 4093, 198, 26843, 17, 2, 198],
    "café 😀": [83, 1939, 2756, 40303, 218],
}
ONE_TURN = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def metadata():
  return read_metadata(open_gguf(resolve_model(DEFAULT_MODEL).path))


@pytest.fixture(scope="module")
def tok(metadata):
  return Tokenizer.from_gguf(metadata)


def test_properties(tok):
  assert tok.vocab_size == 49152
  assert tok.bos_id == 1 and tok.eos_ids == (2,)


@pytest.mark.parametrize("text", list(KNOWN))
def test_known_encodings(tok, text):
  assert tok.encode(text) == KNOWN[text]


def test_digits_split_individually(tok):
  ids = tok.encode("2024")
  assert len(ids) == 4 and [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


@pytest.mark.parametrize(
    "special, i",
    [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2), ("<empty_output>", 16)],
)
def test_special_tokens_are_single_ids(tok, special, i):
  assert tok.encode(special) == [i]
  assert tok.encode(f"a{special}b")[1] == i


@pytest.mark.parametrize(
    "text",
    [
        "",
        " leading space",
        "trailing  ",
        "line1\nline2\r\n\n\ttab",
        "naïve façade Ångström",
        "日本語のテキスト 한국어 Россия مرحبا",
        "emoji 😀👍🏽🇺🇸 ❤️",
        "x = [1, 22, 333]; y ** 2",
        "<|im_start|>assistant\nSure!<|im_end|>",
    ],
)
def test_roundtrip(tok, text):
  assert tok.decode(tok.encode(text)) == text


def test_add_bos_and_skip_special(tok):
  ids = tok.encode("<|im_start|>hi", add_bos=True)
  assert ids[0] == 1 and ids[1] == 1
  assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template(tok):
  pytest.importorskip("jinja2")
  msgs = [{"role": "user", "content": "What is 2+2?"}]
  assert tok.apply_chat_template(msgs) == ONE_TURN
  assert tok.apply_chat_template(msgs, add_generation_prompt=False) == ONE_TURN.removesuffix(
      "<|im_start|>assistant\n"
  )
  sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
  assert tok.apply_chat_template(sys_msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
  ids = tok.encode(tok.apply_chat_template(msgs))
  assert ids.count(1) == 3 and ids.count(2) == 2


def test_chatml_fallback_without_jinja2(tok, monkeypatch):
  monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2...` raise ImportError
  monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
  with pytest.warns(RuntimeWarning, match="pip install jinja2"):
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  other = Tokenizer(tok.tok, chat_template="[INST] {{ m }} [/INST]")
  with pytest.raises(ImportError, match="pip install jinja2"):
    other.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_errors(tok):
  pytest.importorskip("jinja2")
  with pytest.raises(ValueError, match="no chat template"):
    Tokenizer(tok.tok).apply_chat_template([{"role": "user", "content": "x"}])
  with pytest.raises(ValueError, match=r"messages\[0\]"):
    tok.apply_chat_template([{"role": "user"}])
  raising = Tokenizer(tok.tok, chat_template="{{ raise_exception('roles must alternate') }}")
  with pytest.raises(ValueError, match="roles must alternate"):
    raising.apply_chat_template([{"role": "user", "content": "x"}])
  with pytest.raises(ValueError, match="no bos_id"):
    Tokenizer(tok.tok).encode("x", add_bos=True)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("smollm", ["Ġ", "1", "2", "3", "4", "5"]),
        ("gpt-2", ["Ġ12345"]),
        ("llama-bpe", ["Ġ", "123", "45"]),
        ("qwen2", ["Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_families(metadata, pre, pieces):
  t = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": pre})
  assert [p for p, _ in t.tok.pre_tokenizer.pre_tokenize_str(" 12345")] == pieces


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert' is not supported"),
        # A SentencePiece vocabulary without its byte pieces cannot fall back to bytes.
        ({"tokenizer.ggml.model": "llama"}, "byte pieces"),
        ({"tokenizer.ggml.pre": "deepseek-coder"}, "tokenizer.ggml.pre='deepseek-coder'"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
    ],
)
def test_from_gguf_errors(metadata, change, match):
  md = {k: v for k, v in {**metadata, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    Tokenizer.from_gguf(md)


def test_from_gguf_path_and_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.gguf"):
    Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_from_file(tok, tmp_path):
  pytest.importorskip("jinja2")
  tok.tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps(
          {
              "bos_token": "<|im_start|>",
              "eos_token": {"content": "<|im_end|>"},
              "chat_template": tok.chat_template,
          }
      )
  )
  t = Tokenizer.from_file(tmp_path / "tokenizer.json")
  assert (t.bos_id, t.eos_ids, t.vocab_size) == (1, (2,), 49152)
  for text, ids in KNOWN.items():
    assert t.encode(text) == ids
  assert t.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]) == ONE_TURN


def test_from_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_file(tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(ValueError, match="not a valid tokenizer.json"):
    Tokenizer.from_file(tmp_path / "tokenizer.json")
