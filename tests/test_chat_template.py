"""A model's chat template comes from its files (GGUF metadata, tokenizer_config.json): it is
rendered in jinja2's immutable sandbox, so a template that reaches Python internals fails
with jinja2's SecurityError instead of running, and a normal template still renders."""

import pytest
import tokenizers

import models.tokenizer
from models.tokenizer import Tokenizer

jinja2 = pytest.importorskip("jinja2")
from jinja2.exceptions import SecurityError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
]


def _tokenizer(chat_template: str) -> Tokenizer:
  """A word-level tokenizer of three tokens: enough for the template's special tokens."""
  vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  return Tokenizer(tok, bos_id=1, eos_ids=(2,), chat_template=chat_template)


def test_a_chatml_template_renders_in_the_sandbox():
  tokenizer = _tokenizer(CHATML)
  assert tokenizer.apply_chat_template(MESSAGES) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n"
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
      "<|im_start|>assistant\n"
  )
  assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
      "2+2?<|im_end|>\n"
  )
  # What real templates use besides: the special tokens, loop controls, namespace, the
  # library's raise_exception, attribute access to a message's keys.
  extras = _tokenizer(
      "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
      "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
      "{{ m.content }}{% endfor %}:{{ ns.n }}{{ eos_token }}"
  )
  assert extras.apply_chat_template(MESSAGES) == "<|im_start|>What is 2+2?:1<|im_end|>"


def _escape(tmp_path):
  """Templates that would write `tmp_path/escaped` or set a global of models.tokenizer if
  they ran outside the sandbox (each reaches Python objects a template must not)."""
  target = str(tmp_path / "escaped")
  opener = "__globals__['__builtins__']['open']"
  return {
      "function globals, open()": f"{{{{ raise_exception.{opener}('{target}', 'w').write('x') }}}}",
      "cycler.__init__.__globals__": (
          f"{{{{ cycler.__init__.{opener}('{target}', 'w').write('x') }}}}"
      ),
      "lipsum.__globals__": f"{{{{ lipsum.{opener}('{target}', 'w').write('x') }}}}",
      "str.__class__.__mro__": (
          "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
          "{% if c.__name__ == 'catch_warnings' %}"
          f"{{{{ c.__init__.{opener}('{target}', 'w').write('x') }}}}"
          "{% endif %}{% endfor %}"
      ),
      "set a module global": "{{ raise_exception.__globals__.update({'escaped': 1}) }}",
      "mutate the messages": "{{ messages.append({'role': 'user', 'content': 'escaped'}) }}",
  }


@pytest.mark.parametrize(
    "name",
    [
        "function globals, open()",
        "cycler.__init__.__globals__",
        "lipsum.__globals__",
        "str.__class__.__mro__",
        "set a module global",
        "mutate the messages",
    ],
)
def test_a_template_reaching_python_internals_fails_without_running(tmp_path, name):
  template = _escape(tmp_path)[name]
  messages = [dict(m) for m in MESSAGES]
  with pytest.raises(SecurityError, match=r"access to attribute '\w+' of '\w+' object is unsafe"):
    _tokenizer(template).apply_chat_template(messages)
  assert not (tmp_path / "escaped").exists()
  assert not hasattr(models.tokenizer, "escaped")
  assert messages == MESSAGES  # (the template is given copies: the caller's never change)


def test_printing_an_unsafe_attribute_shows_nothing(tmp_path):
  """Only printed, an unsafe attribute is jinja2's undefined (empty), not the object."""
  leaky = _tokenizer("[{{ raise_exception.__globals__ }}|{{ ''.__class__ }}]")
  assert leaky.apply_chat_template(MESSAGES) == "[|]"


# Real templates (SmolLM2's as its GGUF ships it; the others as their models publish them,
# written out from memory) and conversations to render them with: rendering is bounded, so
# each must still render exactly as jinja2's plain sandbox renders it (the code before the
# bounds), a long conversation included.
REAL_TEMPLATES = {
    "smollm2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
        "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
        "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
        "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
        "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
        "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
        "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
        "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{'<start_of_turn>model\n'}}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
        "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
        "user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    ),
    "qwen2.5": (
        "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
        "    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n"
        "    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.' }}\n    {%- endif %}\n"
        '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
        "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
        'tags:\\n<tools>" }}\n'
        '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n'
        "    {%- endfor %}\n"
        '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function '
        "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
        '<|im_end|>\\n" }}\n'
        "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
        "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
        "    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba "
        "Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
        "{%- for message in messages %}\n"
        '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) '
        'or (message.role == "assistant" and not message.tool_calls) %}\n'
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
        "'\\n' }}\n"
        '    {%- elif message.role == "assistant" %}\n'
        "        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n"
        "            {{- '\\n' + message.content }}\n        {%- endif %}\n"
        "        {%- for tool_call in message.tool_calls %}\n"
        "            {%- if tool_call.function is defined %}\n"
        "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
        '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
        '            {{- \'", "arguments": \' }}\n'
        "            {{- tool_call.arguments | tojson }}\n            {{- '}\\n</tool_call>' }}\n"
        "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
        '    {%- elif message.role == "tool" %}\n'
        '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
        "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
        "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
        "        {{- '\\n</tool_response>' }}\n"
        '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
        "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n"
        "{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
        "{%- endif %}\n"
    ),
}
NO_SYSTEM_ROLE = ("gemma", "mistral")


def _conversation(turns: int, words: int, system: bool) -> list[dict]:
  """`turns` alternating user/assistant messages of `words` words (and padding to trim)."""
  text = lambda i: f" turn {i}: " + " ".join(f"w{(i * 7 + j) % 101}" for j in range(words)) + "\n"
  messages = [{"role": ("user", "assistant")[i % 2], "content": text(i)} for i in range(turns)]
  return [{"role": "system", "content": "Be brief."}, *messages] if system else messages


def _plain_sandbox_render(template: str, messages, add_generation_prompt: bool) -> str:
  """The template rendered as before the bounds: jinja2's immutable sandbox, unbounded."""
  import jinja2.sandbox

  def raise_exception(msg):
    raise ValueError(f"chat template: {msg}")

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template).render(
      messages=messages,
      add_generation_prompt=add_generation_prompt,
      bos_token="<|im_start|>",
      eos_token="<|im_end|>",
  )


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_templates_render_as_before(name):
  template = REAL_TEMPLATES[name]
  tokenizer = _tokenizer(template)
  system = name not in NO_SYSTEM_ROLE
  # Two turns, and 600 turns of ~1.6 MB in all: far more than a model's context holds.
  for messages in (_conversation(2, 8, system), _conversation(600, 400, system)):
    for generation_prompt in (True, False):
      rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
      assert rendered == _plain_sandbox_render(template, messages, generation_prompt)
  assert len(rendered) > sum(len(m["content"]) for m in messages) * 0.9  # (the long one)
  # The templates' own errors are still theirs.
  if name in NO_SYSTEM_ROLE:
    with pytest.raises(ValueError, match="^chat template: Conversation roles must alternate"):
      tokenizer.apply_chat_template(_conversation(2, 2, False)[::-1])


def test_real_templates_render_the_expected_text():
  """Two of them spelled out, so the comparison above is not only with itself."""
  messages = [{"role": "user", "content": "  Hi!\n"}, {"role": "assistant", "content": "Hello."}]
  assert _tokenizer(REAL_TEMPLATES["llama3"]).apply_chat_template(messages) == (
      "<|im_start|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n"
  )
  assert _tokenizer(REAL_TEMPLATES["gemma"]).apply_chat_template(messages) == (
      "<|im_start|><start_of_turn>user\nHi!<end_of_turn>\n"
      "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>model\n"
  )


def test_a_long_message_is_within_the_bounds():
  """The size bound grows with the messages: 4 MB of content (more than the bound's constant
  part) and a template that prints it twice still render."""
  content = "x" * (4 << 20)
  twice = _tokenizer("{% for m in messages %}{{ m.content }}|{{ m.content|upper }}{% endfor %}")
  assert twice.apply_chat_template([{"role": "user", "content": content}]) == (
      f"{content}|{content.upper()}"
  )


# Templates that burn CPU or memory unless the render is bounded, and the bound each must hit
# (issue 45, finding 7: the first three as the issue reports them; the others the same attack
# by other means). The bounds: models/tokenizer.py, _TEMPLATE_*.
HOSTILE = {
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "a gigabyte string": ("{{ 'a' * 1000000 * 1000 }}", "characters"),
    "a recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "nested loops over a string": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "a macro calling itself twice": (
        (
            "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
            "{{ f(40) }}"
        ),
        "steps",
    ),
    "doubling with ~": (
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
        ),
        "characters",
    ),
    "doubling with +": (
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"
        ),
        "characters",
    ),
    "doubling in a block": (
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set twice %}{{ ns.s }}"
            "{{ ns.s }}{% endset %}{% set ns.s = twice %}{% endfor %}{{ ns.s|length }}"
        ),
        "characters",
    ),
    "a power": ("{{ 7 ** 100000000 }}", "bits"),
    "repeated squaring": (
        (
            "{% set ns = namespace(x=3) %}{% for i in range(64) %}"
            "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}"
        ),
        "bits",
    ),
    "center": ("{{ 'a'|center(1000000000) }}", "characters"),
    "str.replace": ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", "characters"),
    "a % width": ("{{ '%1000000000s' % 'a' }}", "characters"),
    "a str.format width": ("{{ '{:>1000000000}'.format('a') }}", "characters"),
    "expandtabs": ("{{ ('\\t' * 100000).expandtabs(100000) }}", "characters"),
    "indent": ("{{ ('\\n' * 100000)|indent(100000, true, true) }}", "characters"),
    "join": (
        "{% set s = 'x' * 1000000 %}{{ [" + ", ".join(["s"] * 1000) + "]|join }}",
        "characters",
    ),
    "lipsum": ("{{ lipsum(1000000) }}", "characters"),
}

# Renders each template of stdin's {name: template} in this child (unbounded, one would hang
# or take gigabytes: each has 10 s and the child 4 GiB) and prints a JSON line per template:
# the error, the seconds and how far the child's peak memory (ru_maxrss) has grown since a
# first, plain render (peaks only grow: a bound on this template's and every earlier one's).
_RENDER_HOSTILE = """
import json, resource, signal, sys, time
try:
  resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
except (ValueError, OSError):
  pass
import tokenizers
from models.tokenizer import Tokenizer

def interrupt(signum, frame):
  raise TimeoutError("still rendering after 10 s")

def peak_bytes():
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak * (1 if sys.platform == "darwin" else 1024)

signal.signal(signal.SIGALRM, interrupt)
vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
messages = [{"role": "user", "content": "Hi!"}]
Tokenizer(tok, chat_template="{{ messages[0].content }}").apply_chat_template(messages)
before = peak_bytes()
for name, template in json.load(sys.stdin).items():
  tokenizer = Tokenizer(tok, bos_id=1, eos_ids=(2,), chat_template=template)
  error = None
  start = time.perf_counter()
  signal.alarm(10)
  try:
    try:
      tokenizer.apply_chat_template(messages)
    finally:
      signal.alarm(0)
  except BaseException as e:  # (the alarm too, should it fire as another error is raised)
    error = f"{type(e).__name__}: {e}"
  seconds = time.perf_counter() - start
  grown = peak_bytes() - before
  print(json.dumps({"name": name, "error": error, "seconds": seconds, "grown": grown}), flush=True)
"""


@pytest.fixture(scope="module")
def hostile_renders():
  """{name: (error, seconds, bytes the peak grew)} of every HOSTILE template, rendered in a
  child; should the child die (unbounded, one may take all its memory), the rest in another."""
  import json
  import os
  import pathlib
  import subprocess
  import sys

  if not hasattr(__import__("signal"), "SIGALRM"):
    pytest.skip("needs SIGALRM")
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  renders, pending = {}, list(HOSTILE)
  while pending:
    child = subprocess.run(
        [sys.executable, "-c", _RENDER_HOSTILE],
        input=json.dumps({name: HOSTILE[name][0] for name in pending}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=root,
        env=env,
    )
    for line in child.stdout.splitlines():
      record = json.loads(line)
      renders[record["name"]] = (record["error"], record["seconds"], record["grown"])
    done = [name for name in pending if name in renders]
    if len(done) < len(pending):  # the child died rendering the first one not done
      died = pending[len(done)]
      last = (child.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
      renders[died] = (f"the child died (exit {child.returncode}): {last}", None, None)
    pending = [name for name in pending if name not in renders]
  return renders


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_template_that_burns_cpu_or_memory_fails_in_one_line(hostile_renders, name):
  """Refused with a one-line ValueError naming the bound it hit, in well under a second or
  two and a few MiB (unbounded: minutes and gigabytes, or a RecursionError)."""
  error, seconds, grown = hostile_renders[name]
  limit = HOSTILE[name][1]
  assert error is not None and error.startswith("ValueError: chat template: "), error
  assert "exceeds" in error and limit in error and "\n" not in error, error
  assert seconds < 2.0, (seconds, error)
  assert grown < 64 * 2**20, (grown, error)


def test_the_cli_refuses_such_a_template_in_one_line_before_any_work(tmp_path, capsys):
  """A model directory whose chat_template.jinja recurses: `kvjax generate` renders the
  template before its work begins, so it exits 2 with one line (before the bounds: exit 1,
  "failed: RecursionError"). (The template that loops does the same; unbounded, it would
  not end, so it is not run here.)"""
  name = "a recursive macro"
  from kvjax import cli
  from kvjax.testing import tiny_hf_checkpoint

  model = tiny_hf_checkpoint(tmp_path / "model")
  (model / "chat_template.jinja").write_text(HOSTILE[name][0], encoding="utf-8")
  assert cli.main(["generate", "--model", str(model), "--max-new-tokens", "2", "abc"]) == 2
  lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvjax")]
  assert len(lines) == 1 and lines[0].startswith("kvjax generate: error: chat template: ")
  assert "exceeds" in lines[0] and HOSTILE[name][1] in lines[0]


# What the bounds wrap (loops, `~`, calls, filters, operators, printed values, blocks) in
# the ways templates use it: each must render as jinja2's plain sandbox renders it.
FEATURES = {
    "loop variables": (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.revindex0 }}"
        "{{ loop.first }}{{ loop.last }}{{ loop.cycle('a', 'b') }}{{ loop.previtem is defined }}"
        "{% if loop.changed(m.role) %}*{% endif %}{% endfor %}"
    ),
    "for else, filtered, unpacked, nested": (
        "{% for x in [] %}x{% else %}empty{% endfor %}"
        "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}"
        "{% for k, v in {'b': 1, 'a': 2}|dictsort %}{{ k }}={{ v }};{% endfor %}"
        "{% for m in messages %}{% for c in m.content[:3] %}{{ c }}{% endfor %}{% endfor %}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    ),
    "a recursive loop": (
        "{% for n in [{'v': 1, 'c': [{'v': 2, 'c': []}]}, {'v': 3, 'c': []}] recursive %}"
        "({{ n.v }}{{ loop(n.c) }}){% endfor %}"
    ),
    "~ and +": (
        "{{ 1 ~ none ~ undefined_name ~ 'x' ~ 2.5 ~ [1] }}|{{ 'a' + 'b' }}|{{ [1] + [2] }}"
        "|{{ 3 * 'ab' }}|{{ 2 ** 10 }}|{{ 7 % 3 }}|{{ '%s-%d' % ('x', 4) }}|{{ (1, 2) * 2 }}"
    ),
    "filters": (
        "{{ messages|map(attribute='role')|join(', ') }}|{{ 'a b'|replace(' ', '_', 1) }}"
        "|{{ 'ab'|center(6) }}|{{ 'x\\ny'|indent(2, true) }}|{{ '%s!'|format('hi') }}"
        "|{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }}|{{ [1, 2, 3]|slice(2)|list }}"
        "|{{ [[1], [2]]|sum(start=[]) }}|{{ messages[0]|tojson }}|{{ ('a' * 3)|length }}"
        "|{{ 'long words here'|wordwrap(5) }}|{{ 'abc'|list }}|{{ messages|length }}"
        "|{{ {'a': 1}|pprint }}|{{ 12345|string }}|{{ ' x '|trim|upper }}"
    ),
    "methods": (
        "{{ 'a-b'.split('-') }}{{ '-'.join(['a', 'b']) }}{{ ', '.join(messages|map(attribute="
        "'role')) }}{{ '{} {x}'.format(1, x=2) }}{{ 'ab'.ljust(4, '.') }}{{ '7'.zfill(3) }}"
        "{{ 'a\\tb'.expandtabs(4) }}{{ 'aXa'.replace('a', 'bb') }}{{ messages[0].get('role') }}"
        "{{ 'ab'.startswith('a') }}{{ {'a': 1}.items()|list }}"
    ),
    "macros, call and filter blocks, set blocks, namespaces": (
        "{% macro m(x, y='d') %}<{{ x }}{{ y }}{{ caller() if caller }}>{% endmacro %}"
        "{{ m(1) }}{% call m(2, 'e') %}inner{% endcall %}"
        "{% filter upper %}shout {{ messages[0].role }}{% endfilter %}"
        "{% set block %}{% for m in messages %}{{ m.role }}{% endfor %}{% endset %}[{{ block }}]"
        "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }}{{ ns.s }}"
    ),
    "autoescape and raw": (
        "{% autoescape true %}{{ '<b>' }}{{ '<' ~ 'i>' }}{% endautoescape %}{{ '<u>' }}"
        "{% raw %}{{ not a tag }}{% endraw %}"
    ),
    "whitespace control and add_generation_prompt": (
        "{%- for m in messages -%}\n  {{- m.content -}}\n{%- endfor -%}\n"
        "{% if add_generation_prompt %}\n  gen\n{% endif %}\n"
    ),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_jinja2_features_render_as_in_the_plain_sandbox(name):
  template = FEATURES[name]
  rendered = _tokenizer(template).apply_chat_template(MESSAGES)
  assert rendered == _plain_sandbox_render(template, MESSAGES, True)
