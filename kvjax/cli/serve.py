"""`kvjax serve`: an OpenAI-compatible HTTP server over continuous batching (kvjax.serving).

kvjax serve --policy h2o --budget 256 --kv-memory 64MiB     # 127.0.0.1:8000, no keys
kvjax serve --api-keys keys.txt --host 0.0.0.0 --port 8000  # one tenant per key
"""

from __future__ import annotations

import os
import re
import sys

from kvjax.cli import common
from kvjax.cli.spec_flags import add_dataclass_flags, check_spec_model, spec_from_args

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(text: str, flag: str) -> int:
  """'64MiB' -> 67108864; a number with a unit (B, KB, MB, GB, KiB, MiB, GiB) or bytes."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
  if match is None or match.group(2).lower() not in _UNITS:
    raise ValueError(f"{flag} must be bytes with a unit, e.g. 64MiB or 2GB; got {text!r}")
  value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
  if value < 1:
    raise ValueError(f"{flag} must be at least one byte, got {text!r}")
  return value


def read_api_keys(path: str) -> set[str]:
  """One key per line (blank lines and # comments skipped); each key its own tenant."""
  from kvjax.eval import _data

  keys = set()
  for n, line in enumerate(_data.read_text(path).splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if len(line) < 8 or any(c.isspace() for c in line):
      raise ValueError(f"{path}:{n}: an API key is one word of at least 8 characters")
    keys.add(line)
  if not keys:
    raise ValueError(f"{path}: no API key in the file")
  return keys


def add_parsers(subparsers) -> None:
  import kvjax

  serve = subparsers.add_parser(
      "serve",
      help="an OpenAI-compatible HTTP server: continuous batching over one page pool",
      description="Serves /v1/chat/completions, /v1/completions (with streaming), /v1/models, "
      "/health and /metrics. The compression flags set the server's default spec; a request "
      'may choose its own policy and budget in a "compression" field.',
  )
  common.add_model_flag(serve, "registry name, .gguf file or local HF checkpoint directory")
  serve.add_argument(
      "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
  )
  serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free one)")
  serve.add_argument(
      "--kv-memory",
      default="64MiB",
      help="K/V bytes of the page pool all requests share (default: 64MiB)",
  )
  serve.add_argument("--rows", type=int, default=8, help="requests decoded at once (default: 8)")
  serve.add_argument("--queue", type=int, default=64, help="requests waiting at most (default: 64)")
  serve.add_argument(
      "--max-tokens",
      type=int,
      default=None,
      help="tokens a request holds at most (default: the model context)",
  )
  serve.add_argument(
      "--api-keys", default=None, help="a file of API keys, one per line, each its own tenant"
  )
  serve.add_argument(
      "--contexts",
      default=None,
      help="directory of compressed contexts (POST /v1/contexts), one private folder per "
      "tenant (default: contexts/ in kvjax's cache directory)",
  )
  serve.add_argument(
      "--context-ttl", type=float, default=3600.0, help="seconds a context lives (default: 3600)"
  )
  serve.add_argument(
      "--context-quota", default="256MiB", help="bytes of contexts per tenant (default: 256MiB)"
  )
  add_dataclass_flags(serve, kvjax.CompressionSpec, title="compression (the server's default spec)")
  serve.set_defaults(func=_serve)


def _serve(args) -> int:
  from kvjax.serving import Engine, EngineConfig
  from kvjax.serving._contexts import ContextStore
  from kvjax.serving.http import make_app, serve

  spec = spec_from_args(args)
  kv_memory = parse_bytes(args.kv_memory, "--kv-memory")
  quota = parse_bytes(args.context_quota, "--context-quota")
  if not args.context_ttl > 0:
    raise ValueError(f"--context-ttl must be > 0 seconds, got {args.context_ttl}")
  if not 0 <= args.port <= 65535:
    raise ValueError(f"--port must be in [0, 65535], got {args.port}")
  keys = read_api_keys(args.api_keys) if args.api_keys is not None else None
  config = EngineConfig(
      rows=args.rows, kv_memory=kv_memory, max_tokens=args.max_tokens, queue=args.queue
  )
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model, spec)
  engine = Engine(model, tokenizer, spec, config)
  contexts = None
  directory = args.contexts
  if directory is None:
    from kvjax_store.cache_dir import private_dir

    directory = private_dir("contexts")
  if directory is not None:
    contexts = ContextStore(directory, model, tokenizer, ttl=args.context_ttl, quota=quota)
  name = os.path.basename(os.fspath(args.model)).removesuffix(".gguf")
  common.begin_work(args)
  engine.start()
  app = make_app(engine, model_name=name, api_keys=keys, contexts=contexts)

  def ready(port):
    print(f"kvjax serve: {name} on http://{args.host}:{port}/v1", file=sys.stderr, flush=True)

  serve(app, args.host, args.port, ready=ready)
  return 0
