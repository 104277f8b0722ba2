"""Exit 2 means the input was refused and nothing ran; once a command's work has begun any
error, even a ValueError or an OSError, is a failure of the run: exit 1, one line (issue
31, part 5). The commands run in this process on a tiny random model (`common.load_model` is
replaced), so each test takes a few seconds."""

import errno

import pytest

import kvjax
from kvjax import cli
from kvjax.cli import common
from kvjax.testing import ByteTokenizer, tiny_llama

# orbax leaves an asyncio callback behind when a restore of damaged files fails.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MAX_CONTEXT = 256


@pytest.fixture
def tiny(monkeypatch):
  """`kvjax ...` loads a tiny random model (byte tokens, context 256) instead of a real one."""
  model, tokenizer = tiny_llama(max_context=MAX_CONTEXT), ByteTokenizer()
  monkeypatch.setattr(common, "load_model", lambda name: (model, tokenizer))
  return model, tokenizer


def _main(capsys, *argv) -> tuple[int, str]:
  """(exit code, the one `kvjax ...` line on stderr)."""
  code = cli.main(list(argv))
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith("kvjax")]
  assert len(lines) == 1, err
  return code, lines[0]


def _full_disk(*args, **kwargs):
  raise OSError(errno.ENOSPC, "No space left on device")


def test_generate_refuses_what_the_model_cannot_do_and_fails_what_breaks_while_running(
    tiny, capsys, monkeypatch
):
  code, line = _main(capsys, "generate", "hi", "--no-chat", "--max-new-tokens", "9000")
  assert (code, line) == (2, line) and "exceeds the model context 256" in line
  assert line.startswith("kvjax generate: error: ")

  def broken(*args, **kwargs):  # e.g. a bad value found while decoding
    raise ValueError("the decoded state is inconsistent")

  monkeypatch.setattr(kvjax.runtime.generation, "decode", broken)
  for extra in ([], ["--json"]):
    code, line = _main(capsys, "generate", "hi", "--no-chat", "--max-new-tokens", "4", *extra)
    assert code == 1, line
    assert line == (
        "kvjax generate: failed: ValueError: the decoded state is inconsistent "
        "(KVJAX_DEBUG=1 shows the traceback)"
    )


def test_a_full_disk_while_saving_a_prefilled_state_exits_1(tiny, tmp_path, capsys, monkeypatch):
  context = tmp_path / "context.txt"
  context.write_text("My name is Ada and my cat is called Pixel. " * 2)
  argv = ["prefill", "--context", str(context), "--save", str(tmp_path / "s"), "--no-chat"]
  (tmp_path / "long.txt").write_text("x" * (MAX_CONTEXT + 1))
  code, line = _main(capsys, *argv[:1], "--context", str(tmp_path / "long.txt"), *argv[3:])
  assert code == 2 and "257 tokens" in line and "longer than the model context 256" in line
  monkeypatch.setattr(kvjax, "save_state", _full_disk)
  code, line = _main(capsys, *argv, "--quiet")
  assert code == 1, line
  assert line.startswith("kvjax prefill: failed: OSError: [Errno 28] No space left on device")


def test_a_damaged_state_is_refused_before_the_model_loads(tiny, tmp_path, capsys):
  context = tmp_path / "context.txt"
  context.write_text("My name is Ada and my cat is called Pixel. " * 2)
  save = tmp_path / "state"
  argv = ["prefill", "--context", str(context), "--save", str(save), "--no-chat", "--quiet"]
  assert cli.main(argv) == 0
  capsys.readouterr()
  code, line = _main(capsys, "ask", str(tmp_path / "none"), "Who?")
  assert code == 2 and "no saved kvjax state there" in line
  # Its arrays cut in half: `state_info` checks them (digest and structure) as `load_state`
  # does, so `ask` refuses the state as a usage error, before loading the model.
  files = [f for f in save.rglob("*") if f.is_file() and "arrays" in f.parts]
  largest = max(files, key=lambda f: f.stat().st_size)
  largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
  code, line = _main(capsys, "ask", str(save), "Who?", "--max-new-tokens", "2")
  assert code == 2, line
  assert line.startswith("kvjax ask: error: ") and "damaged" in line, line


def test_eval_refuses_lengths_past_the_model_and_fails_when_results_cannot_be_saved(
    tiny, tmp_path, capsys, monkeypatch
):
  text = tmp_path / "text.txt"
  text.write_text("The grass is green and the sky is blue. " * 40)
  argv = ["eval", "fidelity", "--text", str(text), "--out", str(tmp_path / "o"), "--quiet"]
  argv += ["--policy", "full", "--windows", "1", "--continuation-tokens", "8"]
  code, line = _main(capsys, *argv, "--context-tokens", "9000")
  assert code == 2 and "context_tokens=9000 exceeds the model context 256" in line
  from kvjax.eval import _report

  monkeypatch.setattr(_report, "write", _full_disk)
  code, line = _main(capsys, *argv, "--context-tokens", "64")
  assert code == 1, line
  assert line.startswith("kvjax eval: failed: OSError: [Errno 28] No space left on device")


def test_tune_fails_with_1_once_it_began(tiny, tmp_path, capsys, monkeypatch):
  from kvjax import tuning

  text = tmp_path / "text.txt"
  text.write_text("The grass is green and the sky is blue. " * 40)

  def tune(model, tokenizer, *, progress, **options):
    if options["steps"] == 1:  # refused before any work: no progress line yet
      raise ValueError("the sample is too short")
    progress("calibrating")
    raise ValueError("the search diverged")

  monkeypatch.setattr(tuning, "tune", tune)
  argv = ["tune", "--text", str(text), "--out", str(tmp_path / "t"), "--quiet"]
  assert _main(capsys, *argv, "--steps", "1") == (2, "kvjax tune: error: the sample is too short")
  code, line = _main(capsys, *argv)
  assert code == 1 and line.startswith("kvjax tune: failed: ValueError: the search diverged")


def test_train_scorer_checks_the_model_then_fails_with_1(tiny, tmp_path, capsys, monkeypatch):
  from kvjax.tuning import scorer_training as training

  text = tmp_path / "text.txt"
  text.write_text("The grass is green and the sky is blue. " * 40)
  monkeypatch.setattr(training, "train_scorer", _full_disk)
  argv = ["train-scorer", "--text", str(text), "--out", str(tmp_path / "s"), "--quiet"]
  argv += ["--windows", "2", "--held-out", "0.5"]
  code, line = _main(capsys, *argv, "--context-tokens", "300")
  assert code == 2 and "is longer than the model context (256)" in line
  code, line = _main(capsys, *argv, "--context-tokens", "64")
  assert code == 1 and line.startswith("kvjax train-scorer: failed: OSError: [Errno 28]")


def test_doctor_has_no_input_so_its_errors_exit_1(capsys, monkeypatch):
  from kvjax.cli import doctor

  monkeypatch.setattr(doctor, "report", _full_disk)
  code, line = _main(capsys, "doctor", "--json", "--no-self-check")
  assert code == 1 and line.startswith("kvjax doctor: failed: OSError: [Errno 28]")
