"""The README's first two commands are the project's set-up contract; CI runs the second."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
  test_command = _readme_commands()[1].strip()
  assert "pytest" in test_command
  assert test_command in (ROOT / ".ci" / "run").read_text()


def test_readme_python_calls_on_text_say_whether_they_chat():
  """The Python API continues raw text unless chat=True, the CLI chats by default: a README
  example that sends an instruction without saying which one it means would mislead."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
  calls = re.findall(r"kvjax\.(?:generate|prefill)\((?:[^()]|\([^()]*\))*\)", "\n".join(blocks))
  assert calls
  for call in calls:
    assert "chat=" in call, call
