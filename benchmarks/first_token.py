"""Time to first token in a fresh process, and its peak memory: kvjax vs transformers.

    python -m benchmarks.first_token [--repeats 3] [--prompt TEXT]

Each run is a new Python process that imports its library, loads the default model from its
GGUF (kvjax: Flax NNX float32; transformers: `AutoModelForCausalLM`, float32, sdpa) and
answers one short prompt (the same token ids) with one greedy token. The time runs from
spawning the process to the token being on the host; the peak is the process's maximum
resident set (VmHWM). Runs alternate A B A B; medians. kvjax runs once beforehand so
that JAX's persistent compilation cache (`$KVJAX_CACHE_DIR/jax`) holds its executables and
its weight cache the converted weights: the case of any second run on a machine. Prints markdown.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

# Each child gets the prompt's token ids (argv[1], comma-separated) and prints
# "<loaded time> <first-token time> <token> <peak RSS KiB>". The peak is the child's own
# VmHWM: `wait4`'s ru_maxrss would start from the parent's RSS at fork.
_KVJAX = """
import sys, time
import kvjax
from models import load_llama
ids = [int(i) for i in sys.argv[1].split(",")]
model, tok = load_llama()
loaded = time.time()
result = kvjax.generate(model, tok, [ids], max_new_tokens=1)
first = time.time()
peak = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(loaded, first, result.tokens[0][0], peak)
"""

_TRANSFORMERS = """
import sys, time, warnings
import torch, transformers
from models import resolve_model
warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
ids = [int(i) for i in sys.argv[1].split(",")]
path = resolve_model().path
ref = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
).eval()
loaded = time.time()
with torch.no_grad():
  out = ref.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
first = time.time()
peak = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(loaded, first, int(out[0, -1]), peak)
"""


def _run(code: str, ids: list[int]) -> dict:
  """One fresh process: seconds to the model loaded and to the first token, peak RSS MiB."""
  with tempfile.TemporaryFile("w+") as err:
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, ",".join(map(str, ids))],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    out = proc.stdout.read()
    proc.wait()
    if proc.returncode != 0:
      err.seek(0)
      raise RuntimeError(f"benchmark process failed:\n{err.read()[-2000:]}")
  loaded, first, token, peak = out.split()[-4:]
  return {
      "load": float(loaded) - start,
      "first": float(first) - start,
      "token": int(token),
      "rss": int(peak) / 1024,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--prompt", default="The capital of France is")
  args = parser.parse_args(argv)
  from models import Tokenizer, resolve_model

  # The tokenizer alone: a parent holding the model would make nothing else slower, but
  # its children would start from its memory.
  ids = Tokenizer.from_gguf(resolve_model().path).encode(args.prompt)
  _run(_KVJAX, ids)  # fills the persistent compilation cache
  runs = {"kvjax": [], "transformers": []}
  for _ in range(args.repeats):
    runs["kvjax"].append(_run(_KVJAX, ids))
    runs["transformers"].append(_run(_TRANSFORMERS, ids))
  print(
      f"# Fresh process, one short prompt, one token ({args.repeats} runs each, A B A B, "
      f"medians), {time.strftime('%Y-%m-%d')}\n"
  )
  print("| | process start to model loaded, s | to first token, s | peak RSS, MiB | token |")
  print("|---|---:|---:|---:|---:|")
  for name, rows in runs.items():
    med = {k: statistics.median(r[k] for r in rows) for k in ("load", "first", "rss")}
    tokens = sorted({r["token"] for r in rows})
    print(
        f"| {name} | {med['load']:.2f} | {med['first']:.2f} | {med['rss']:.0f} "
        f"| {', '.join(map(str, tokens))} |"
    )
  ratio = statistics.median(r["first"] for r in runs["kvjax"]) / statistics.median(
      r["first"] for r in runs["transformers"]
  )
  print(f"\nkvjax / transformers, time to first token: {ratio:.2f}")


if __name__ == "__main__":
  main()
