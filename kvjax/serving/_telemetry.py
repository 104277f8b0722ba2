"""The server's telemetry: the operator's log (logger "kvjax.serve": one line per /v1 request
once it ended, `log_request`) and the Prometheus text of /metrics (`Telemetry`: the requests
answered, by endpoint and HTTP status, and the engine's gauges). It knows no route: it reads
the engine through `stats` and `unavailable` only.
"""

from __future__ import annotations

import logging
import time
import urllib.parse

log = logging.getLogger("kvjax.serve")

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/contexts", "/v1/models")


def endpoint_label(path: str) -> str:
  """A request's endpoint as /metrics counts it: a route, never a context's id."""
  if path.startswith("/v1/contexts/"):
    return "/v1/contexts"
  return path if path in _ENDPOINTS else "other"


def printable(path: str) -> str:
  """A request path as a log line shows it: a control character, a space or a quote
  percent-encoded, so that no path adds a line to the log."""
  return urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~%", errors="backslashreplace")


def log_request(
    tenant, method, endpoint, status, started, job=None, generated=None, prompt_tokens=None
):
  """The request's line in the operator's log (logger "kvjax.serve", INFO) once it ended:
  its tenant (a digest of its key, never the key), endpoint, prompt tokens, the share of
  them its K/V kept, tokens generated, K/V bytes held once its prompt was read, seconds and
  HTTP status ("-": not known, e.g. a request refused before it was read). A failure (5xx)
  is an ERROR, the rest INFO."""
  level = logging.ERROR if isinstance(status, int) and status >= 500 else logging.INFO
  if not log.isEnabledFor(level):
    return
  if job is not None and prompt_tokens is None:
    prompt_tokens = job.prompt_tokens
  kept = None if job is None or job.kept_share is None else f"{job.kept_share:.3f}"
  kv_bytes = None if job is None else job.kv_bytes
  log.log(
      level,
      "tenant=%s %s %s prompt_tokens=%s kept_share=%s generated_tokens=%s kv_bytes=%s "
      "seconds=%.3f status=%d",
      tenant,
      method,
      endpoint,
      _or_dash(prompt_tokens),
      _or_dash(kept),
      _or_dash(generated),
      _or_dash(kv_bytes),
      time.perf_counter() - started,
      status,
  )


def _escaped(value: str) -> str:
  """A Prometheus label value: backslash, quote and newline escaped (the text format's)."""
  return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _or_dash(value) -> str:
  return "-" if value is None else str(value)


class Telemetry:
  """The requests the server answered, by endpoint (`endpoint_label`) and HTTP status."""

  def __init__(self):
    self.requests: dict[tuple[str, int], int] = {}

  def finish(self, scope: dict, endpoint: str, status: int, job=None, generated=None):
    """Counts an answered request (by `endpoint`, its label in /metrics) and logs it
    (`scope`: the request's ASGI scope; a /v1 or /metrics request's holds its tenant and
    arrival)."""
    self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1
    state = scope.get("state", {})
    if "started" in state:
      tenant, started = state["tenant"], state["started"]
      path = printable(scope["path"])
      log_request(tenant, scope["method"], path, status, started, job, generated)

  def metrics(self, engine) -> str:
    """The Prometheus text exposition of the server's counters and `engine`'s gauges."""
    stats = engine.stats()
    lines = [
        "# HELP kvjax_requests_total HTTP requests answered, by endpoint and status.",
        "# TYPE kvjax_requests_total counter",
    ]
    for (endpoint, status), n in sorted(self.requests.items()):
      labels = f'endpoint="{_escaped(endpoint)}",status="{int(status)}"'
      lines.append(f"kvjax_requests_total{{{labels}}} {n}")
    page = stats["page_bytes"]
    gauges = {
        "kvjax_engine_up": (
            "1 while the engine takes requests, 0 once it stopped",
            int(engine.unavailable() is None),
        ),
        "kvjax_queue_depth": ("requests waiting for memory or a row", stats["queue"]),
        "kvjax_rows_in_use": ("rows (slots) decoding a request", stats["rows_in_use"]),
        "kvjax_rows": ("rows of the served batch", stats["rows"]),
        "kvjax_kv_bytes_reserved": (
            "K/V bytes the running requests' plans reserve",
            stats["pages_reserved"] * page,
        ),
        "kvjax_kv_bytes_pool": ("K/V bytes of the page pool", stats["pages"] * page),
        "kvjax_tokens_per_second": (
            "tokens generated per second, last round",
            stats["tokens_per_s"],
        ),
    }
    for name, (text, value) in gauges.items():
      lines += [f"# HELP {name} {text}.", f"# TYPE {name} gauge", f"{name} {value}"]
    lines += [
        "# HELP kvjax_generated_tokens_total tokens generated.",
        "# TYPE kvjax_generated_tokens_total counter",
        f"kvjax_generated_tokens_total {stats.get('generated_tokens', 0)}",
    ]
    return "\n".join(lines) + "\n"
