"""What the `kvjax` commands share: the exit codes, the parser classes, the mark where a
command's work begins, the --model flag, model loading and the prefill progress bar."""

from __future__ import annotations

import argparse
import sys
import time

from models.registry import DEFAULT_MODEL

EXIT_USAGE = 2  # bad command line or input: nothing ran
EXIT_FAILED = 1  # the run itself failed


def begin_work(args) -> None:
  """Marks where a command's real work begins: its first computation or write, after every
  check of the command line, the input files and the model. Before it, a ValueError,
  TypeError or OSError is the user's input refused (exit 2: nothing ran); from it on, any
  error is a failure of the run (exit 1), even a ValueError (a damaged saved state) or an
  OSError (a full disk)."""
  args.work_began = True


class HelpFormatter(argparse.HelpFormatter):
  """Adds "(default: X)" to an option's help unless it states its default already (flags
  whose default None means "not given" say what applies instead)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" in text or any(action.default is d for d in (None, False, argparse.SUPPRESS)):
      return text
    return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
  """argparse with a one-line error (no usage block) and defaults in every --help."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message):
    print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def add_model_flag(parser, help_text: str = "registry name, .gguf or HF dir") -> None:
  """--model, defaulting to the registry's default model."""
  parser.add_argument("--model", default=DEFAULT_MODEL, help=help_text)


def model_source(name: str) -> str:
  """How a later process, in any directory, names the model `name` names here: a registry
  name as it is (the registry finds its file), a path made absolute. ValueError (or
  FileNotFoundError) for a name the registry does not know, before anything loads."""
  import os

  from models.registry import known_models, resolve_model

  source = resolve_model(name)
  if os.fspath(name).lower() in known_models():
    return os.fspath(name).lower()
  return str(source.path.resolve())


def wants_chat(args, tokenizer) -> bool:
  """`--chat`/`--no-chat` as given; unset, on where the model has a chat template
  (instruction-tuned models carry one; a base model completes text)."""
  if args.chat is not None:
    return args.chat
  return getattr(tokenizer, "chat_template", None) is not None


def load_model(name: str):
  """The model and tokenizer; an unknown name or a missing file fails before "loading"."""
  import jax

  import models
  from models.registry import resolve_model

  resolve_model(name)
  start = time.perf_counter()
  print(f"loading {name} ...", file=sys.stderr, flush=True)
  model, tokenizer = models.load_decoder(name)
  print(
      f"loaded {model.config.name} ({model.config.n_layers} layers) in "
      f"{time.perf_counter() - start:.1f} s on {jax.default_backend()}",
      file=sys.stderr,
      flush=True,
  )
  return model, tokenizer


def show_progress(args) -> bool:
  return not args.quiet and sys.stderr.isatty()


def prefill_bar(args):
  """A progress callback for long prefills (a bar on stderr), or None."""
  if not show_progress(args):
    return None
  from tqdm.auto import tqdm

  bar = None

  def progress(done, total):
    nonlocal bar
    if total < 1024:  # short prompts prefill in about a second: no bar
      return
    if bar is None:
      bar = tqdm(total=total, desc="prefill", unit="tok", leave=False, file=sys.stderr)
    bar.update(done - bar.n)
    if done >= total:
      bar.close()

  return progress


def print_summary(*parts: str) -> None:
  """A run's one-line summary on stderr, `[part; part; ...]` (the answer goes to stdout)."""
  print(f"[{'; '.join(parts)}]", file=sys.stderr)
