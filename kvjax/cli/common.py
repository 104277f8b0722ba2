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


def prefill_bar(args, spec=None):
  """A progress callback for long prefills (a bar on stderr), or None. The bar covers what
  `progress` counts: the context read and, for a policy that compresses it once (`spec`),
  its scoring too (kvzip's reconstruction passes, expected_attention's pass over the keys),
  so it ends when the context is ready to compress; its label says which."""
  if not show_progress(args):
    return None
  from tqdm.auto import tqdm

  scores_once = spec is not None and spec.once
  label = "reading + scoring" if scores_once else "reading"
  bar = None

  def progress(done, total):
    nonlocal bar
    if total < 1024:  # short prompts prefill in about a second: no bar
      return
    if bar is None:
      bar = tqdm(total=total, desc=label, unit="tok", leave=False, file=sys.stderr)
    bar.update(done - bar.n)
    if done >= total:
      bar.close()

  return progress


def read_text_file(path: str) -> str:
  """A UTF-8 text file given on the command line (size-bounded, not binary)."""
  from kvjax.eval import _data

  return _data.read_text(path)


def read_stdin() -> str:
  """UTF-8 text from stdin (size-bounded, not binary)."""
  from kvjax.eval import _data

  return _data.read_stream(sys.stdin.buffer, "stdin")


def mib(num_bytes: int) -> str:
  """Bytes in MiB, with two decimals under 1 MiB."""
  value = num_bytes / 2**20
  return f"{value:.2f}" if value < 1 else f"{value:.1f}"


def tokens_part(stats: dict, row: int = 0) -> str:
  """`21 context + 16 question + 7 generated tokens` (or `37 prompt + ...`) of one row."""
  generated = stats["generated_tokens"][row]
  question = (stats.get("question_tokens") or [0] * (row + 1))[row]
  if question:
    read = f"{stats['context_tokens'][row]} context + {question} question"
  else:
    read = f"{stats['prompt_tokens'][row]} prompt"
  return f"{read} + {generated} generated tokens"


def kv_parts(stats: dict) -> list[str]:
  """`KV held 16.7 of 64.7 MiB (26%)`: the K/V held once the prompt is read against what
  the full cache holds for the same tokens, then the peak where it is higher (while the
  context was read or scored, or while decoding)."""
  held, full = stats["kv_bytes_held"], stats["full_kv_bytes"]
  parts = [f"KV held {mib(held)} of {mib(full)} MiB ({held / max(full, 1):.0%})"]
  context_peak = stats.get("context_peak_kv_bytes") or 0
  peak = max(context_peak, stats.get("peak_kv_bytes") or 0)
  if peak > held and mib(peak) != mib(held):
    if peak == context_peak:
      where = "while scoring" if stats.get("compressed_once") else "while reading"
    else:
      where = "while decoding"
    parts.append(f"peak {mib(peak)} MiB {where}")
  return parts


def print_summary(*parts: str) -> None:
  """A run's one-line summary on stderr, `[part; part; ...]` (the answer goes to stdout)."""
  print(f"[{'; '.join(parts)}]", file=sys.stderr)
