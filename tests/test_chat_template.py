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
