"""The README's first two commands are the project's set-up contract; CI runs the second. The
README is a landing page: short, and every link in it and every benchmark the docs name
exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
# A results row whose numbers are still being measured links the page that will hold them;
# its line carries this marker until the numbers (and the page) land.
PENDING = "numbers pending"


def _readme_commands():
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def _without_code_blocks(text):
  return re.sub(r"```.*?```", "", text, flags=re.S)


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


def test_readme_is_a_landing_page():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert (
      len(lines) <= README_MAX_LINES
  ), f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_links_and_images_exist():
  """Every relative link and image path of README.md names a file or folder of the repository
  (links to the web and to anchors are not checked; a results row marked as pending may link
  the page its numbers will be written to)."""
  missing = []
  for line in _without_code_blocks((ROOT / "README.md").read_text()).splitlines():
    if PENDING in line:
      continue
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)
    targets += re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"", line)
    for target in targets:
      if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
        continue
      path = target.split("#", 1)[0]
      if not (ROOT / path).exists():
        missing.append(target)
  assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_benchmarks_named_in_the_docs_exist():
  """`python -m benchmarks.X` and `benchmarks/X.py` in README.md and docs/*.md name a script
  that exists (benchmarks moved out of the package; a stale name would fail for the reader)."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  missing = []
  for page in pages:
    text = page.read_text()
    names = re.findall(r"python3?\s+-m\s+benchmarks\.([A-Za-z_]\w*)", text)
    names += re.findall(r"(?<![\w/.])benchmarks/([A-Za-z_]\w*)\.py", text)
    for name in names:
      if not (ROOT / "benchmarks" / f"{name}.py").is_file():
        missing.append(f"{page.relative_to(ROOT)}: benchmarks/{name}.py")
  assert not missing, f"benchmarks named but missing: {sorted(set(missing))}"
