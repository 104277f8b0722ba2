"""`kvjax serve`: an OpenAI-compatible HTTP server over continuous batching (kvjax.serving).

kvjax serve --policy h2o --budget 256 --kv-memory 64MiB     # 127.0.0.1:8000, no keys
kvjax serve --api-keys keys.txt --host 0.0.0.0 --port 8000  # one tenant per key

It tells its operator what it does on stderr (logger "kvjax.serve", `--log-level`): a line
when it listens (the model, the compression, the memory, the rows, the keys, the address),
one per request when it ends, one when it stops.
"""

from __future__ import annotations

import logging
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
  """One key per line (blank lines and # comments skipped); each key its own tenant, one word
  of printable ASCII (what an Authorization header carries). A UTF-8 byte order mark at the
  start is not part of the first key."""
  from kvjax.eval import _data

  keys = set()
  text = _data.read_text(path).removeprefix("\ufeff")  # as utf-8-sig reads it
  for n, line in enumerate(text.splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if len(line) < 8 or not all("!" <= c <= "~" for c in line):
      raise ValueError(
          f"{path}:{n}: an API key is one word of at least 8 characters, printable ASCII"
      )
    keys.add(line)
  if not keys:
    raise ValueError(f"{path}: no API key in the file")
  return keys


def allowed_hosts(flag: str | None, host: str) -> set[str] | None:
  """The Host header's names the server answers (None: any): the loopback names and the
  bound `host`, and those of `--allowed-hosts` (comma-separated; `*`: any). Bound to every
  address (0.0.0.0, ::), it cannot know its names: any, unless the flag lists them."""
  from kvjax.serving._guards import LOOPBACK_NAMES, host_name

  given = [] if flag is None else [h.strip() for h in flag.split(",")]
  if "*" in given:
    return None
  if any(not h or not all("!" <= c <= "~" for c in h) for h in given):
    raise ValueError(f"--allowed-hosts takes host names separated by commas, got {flag!r}")
  if not given and host.strip("[]") in ("0.0.0.0", "::", ""):
    return None
  return {*LOOPBACK_NAMES, host_name(host), *map(host_name, given)}


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_to_stderr(level: str) -> logging.Logger:
  """The "kvjax.serve" logger (the engine's "kvjax.serve.engine" under it) on stderr at
  `level`, one line a record."""
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  log = logging.getLogger("kvjax.serve")
  log.handlers = [handler]
  log.setLevel(level.upper())
  log.propagate = False
  return log


def _size(n: int) -> str:
  """Bytes as the --kv-memory flag takes them: 64MiB, 1.5GiB, 1000B."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.4g}{unit}"
  return f"{n}B"


def _keyless_warning(keys, host: str, allowed: bool) -> str | None:
  """The warning a server without keys logs (None: it has keys); a ValueError where other
  machines would reach it and `--allow-no-keys` was not given."""
  from kvjax.serving._guards import is_loopback

  if keys is not None:
    return None
  if is_loopback(host):
    return "no --api-keys: any process on this machine can use this server"
  if not allowed:
    raise ValueError(
        f"--host {host} is reached from other machines: give --api-keys FILE, or "
        "--allow-no-keys to let anyone who reaches it use it"
    )
  return f"no --api-keys and --allow-no-keys: anyone who reaches {host} can use this server"


def _check_servable(spec) -> None:
  """A ValueError naming the flag (`--head-budget layer`) unless the engine can serve `spec`
  (`kvjax.serving._engine.check_servable`): refused before the model loads."""
  from kvjax.serving._engine import Unservable, check_servable

  try:
    check_servable(spec)
  except Unservable as err:
    flag = "--" + err.field.replace("_", "-")
    raise ValueError(f"{flag} {err.value} cannot be served: {err.reason}") from None


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
      "--tenant-requests",
      type=int,
      default=16,
      help="completions and context creations one tenant (API key) may have in flight; "
      "past it, 429 (default: 16)",
  )
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
      "--allow-no-keys",
      action="store_true",
      help="serve without --api-keys on a --host other machines reach (anyone may use it)",
  )
  serve.add_argument(
      "--allowed-hosts",
      default=None,
      help="Host header names the server answers, comma-separated, besides the loopback names "
      "and --host (default: those; any when --host is 0.0.0.0 or ::; *: any). Others get a "
      "400: a web page cannot reach a local server by rebinding its DNS name",
  )
  serve.add_argument(
      "--max-body",
      default="4MiB",
      help="bytes of a request body at most; past it, 413 (default: 4MiB)",
  )
  serve.add_argument(
      "--timeout-idle",
      type=float,
      default=30.0,
      help="seconds a client has to send a request's headers, and may pause while it sends a "
      "body, before its connection is closed (default: 30)",
  )
  serve.add_argument(
      "--drain-timeout",
      type=float,
      default=30.0,
      help="seconds SIGTERM lets the requests in flight finish; what is left then is "
      "cancelled and the process exits (default: 30)",
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
  serve.add_argument(
      "--temperature",
      type=float,
      default=None,
      help="the temperature of requests that give none (default: OpenAI's 1.0; 0: greedy)",
  )
  serve.add_argument(
      "--log-level",
      choices=LOG_LEVELS,
      default="info",
      help="what the server logs on stderr: info, a line when it listens, one per request "
      "when it ends and one when it stops; warning and error, failed requests (5xx) only; "
      "debug adds the engine's admissions (default: info)",
  )
  add_dataclass_flags(serve, kvjax.CompressionSpec, title="compression (the server's default spec)")
  serve.set_defaults(func=_serve)


def _serve(args) -> int:
  from kvjax.runtime.sampling import TEMPERATURE_MAX
  from kvjax.serving import Engine, EngineConfig
  from kvjax.serving._contexts import ContextStore, check_ttl
  from kvjax.serving.http import make_app, serve

  spec = spec_from_args(args)
  _check_servable(spec)
  kv_memory = parse_bytes(args.kv_memory, "--kv-memory")
  quota = parse_bytes(args.context_quota, "--context-quota")
  check_ttl(args.context_ttl, "--context-ttl")
  if not 0 <= args.port <= 65535:
    raise ValueError(f"--port must be in [0, 65535], got {args.port}")
  temperature = 1.0 if args.temperature is None else args.temperature
  if not 0 <= temperature <= TEMPERATURE_MAX:  # NaN fails too
    raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
  keys = read_api_keys(args.api_keys) if args.api_keys is not None else None
  keyless = _keyless_warning(keys, args.host, args.allow_no_keys)
  hosts = allowed_hosts(args.allowed_hosts, args.host)
  max_body = parse_bytes(args.max_body, "--max-body")
  if args.tenant_requests < 1:
    raise ValueError(f"--tenant-requests must be >= 1, got {args.tenant_requests}")
  for flag in ("timeout_idle", "drain_timeout"):
    value = getattr(args, flag)
    if not 0 < value < float("inf"):  # NaN fails too
      name = "--" + flag.replace("_", "-")
      raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
  config = EngineConfig(
      rows=args.rows, kv_memory=kv_memory, max_tokens=args.max_tokens, queue=args.queue
  )
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model, spec)
  engine = Engine(model, tokenizer, spec, config)
  name = os.path.basename(os.fspath(args.model)).removesuffix(".gguf")
  contexts = None
  directory = args.contexts
  if directory is None:
    from kvjax_store.cache_dir import private_dir

    directory = private_dir("contexts")
  if directory is not None:
    contexts = ContextStore(
        directory, model, tokenizer, ttl=args.context_ttl, quota=quota, model_name=name
    )
  common.begin_work(args)
  log = _log_to_stderr(args.log_level)
  if keyless is not None:
    log.warning(keyless)
  engine.start()
  app = make_app(
      engine,
      model_name=name,
      api_keys=keys,
      contexts=contexts,
      default_temperature=temperature,
      allowed_hosts=hosts,
      max_body=max_body,
      tenant_requests=args.tenant_requests,
  )
  compression = "the full cache" if not spec.evicts else f"{spec.policy.name}, budget {spec.budget}"
  tenants = "none (one local tenant)" if keys is None else f"{len(keys)} (a tenant each)"

  def ready(port):
    # `kvjax.testing.start_server` waits for "on http://HOST:PORT/" in this line.
    log.info(
        "%s on http://%s:%d/v1; compression %s; kv-memory %s (%d pages of %d "
        "bytes); %d rows, queue %d; temperature %g by default; API keys: %s",
        name,
        args.host,
        port,
        compression,
        _size(engine.capacity * engine.page_bytes),
        engine.capacity,
        engine.page_bytes,
        config.rows,
        config.queue,
        temperature,
        tenants,
    )

  serve(
      app,
      args.host,
      args.port,
      ready=ready,
      log_level=args.log_level,
      timeout_idle=args.timeout_idle,
      drain_seconds=args.drain_timeout,
  )
  return 0
