"""The wire format's prompts and defaults (kvjax.serving._protocol), without a server: what
a chat's prompt protects, a stored context's document and question, the default
temperature."""

import pytest

from kvjax.serving import _protocol as wire
from kvjax.testing import ByteTokenizer


class ChatTokenizer(ByteTokenizer):
  """ByteTokenizer with a chat template of tags ("<user>...</>"), a system prompt by default."""

  chat_template = "tags"

  def apply_chat_template(self, messages, add_generation_prompt=True):
    if messages[0]["role"] != "system":
      messages = [{"role": "system", "content": "Be brief."}, *messages]
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


TOK = ChatTokenizer()


def _text(segment):
  return TOK.decode(list(segment.text))


def test_a_chats_last_user_message_is_its_protected_question():
  earlier = [
      {"role": "system", "content": "Answer in one word."},
      {"role": "user", "content": "Hello"},
      {"role": "assistant", "content": "Hi"},
  ]
  context, question = wire.chat_prompt(TOK, [*earlier, {"role": "user", "content": "Where?"}])
  assert _text(context) == "<system>Answer in one word.</><user>Hello</><assistant>Hi</>"
  assert _text(question) == "<user>Where?</><assistant>"
  assert (context.protected, question.protected) == (False, True)
  # One message: the template's own system prompt is the context.
  context, question = wire.chat_prompt(TOK, [{"role": "user", "content": "Where?"}])
  assert _text(context) == "<system>Be brief.</>" and question.protected
  # A chat that ends with the assistant's turn asks nothing: all of it is context.
  (context,) = wire.chat_prompt(TOK, earlier)
  assert not context.protected and _text(context).endswith("<assistant>Hi</><assistant>")


def test_a_model_without_a_chat_template_refuses_a_chat_naming_messages():
  with pytest.raises(wire.BadRequest, match="no chat template") as err:
    wire.chat_prompt(ByteTokenizer(), [{"role": "user", "content": "hi"}])
  assert err.value.param == "messages"


def test_a_stored_contexts_document_and_question_close_one_user_message():
  opening, document = wire.document_prompt(TOK, "The code is 4812.")
  assert opening.protected and not document.protected
  assert _text(opening) == "<system>Be brief.</><user>" and _text(document) == "The code is 4812."
  body = wire.ChatRequest(model="m", messages=[{"role": "user", "content": "The code?"}])
  (question,) = wire.question_prompt(TOK, body, chat=True)
  assert question.protected and _text(question) == "\n\nThe code?</><assistant>"
  for messages in ([{"role": "user", "content": " "}], [{"role": "system", "content": "x"}]):
    body = wire.ChatRequest(model="m", messages=messages)
    with pytest.raises(wire.BadRequest) as err:
      wire.question_prompt(TOK, body, chat=True)
    assert err.value.param == "messages"
  with pytest.raises(wire.BadRequest) as err:
    wire.document_prompt(TOK, "\udcff")
  assert err.value.param == "text"


def test_a_request_without_a_temperature_gets_the_servers_default():
  body = wire.CompletionRequest(model="m", prompt="hi")
  assert body.sampling().temperature == 1.0  # OpenAI's
  assert body.sampling(default_temperature=0.0).temperature == 0.0
  given = wire.CompletionRequest(model="m", prompt="hi", temperature=0.7)
  assert given.sampling(default_temperature=0.0).temperature == pytest.approx(0.7)
