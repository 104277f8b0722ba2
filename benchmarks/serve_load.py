"""Load on `kvjax serve`: Poisson arrivals at several rates over one fixed K/V memory, for the
full cache, a running policy at a token budget, kvzip compressing each document once and
int8 pages; transformers' continuous batching on the same model and requests as a peer,
in the same run. Loopback only; every loop is bounded (N requests per rate).

    python -m benchmarks.serve_load --workload decode --requests 16 --rates 0.25 0.5 1 \\
        --kv-memory 24MiB --configs full h2o:192 int8 --transformers --out results/serving
    python -m benchmarks.serve_load --workload questions --requests 24 --rates 0.5 1 \\
        --kv-memory 24MiB --configs full kvzip:0.25

Workloads:
  decode     prompts of 100-300 tokens of real text, 256-512 new tokens each (greedy, run to
             the limit: `ignore_eos`), as long reasoning does; fidelity: each request's
             tokens against the full cache's for the same request (the share that agree
             before the first difference)
  questions  passkey-style questions over 3 documents of ~2k tokens (a code hidden in each):
             the full cache reads the document with every question; `kvzip:F` compresses
             each document once (POST /v1/contexts) and asks with its context_id; accuracy

Reports per configuration and rate: generated tokens/s and requests/s, the most requests
generating at once (between first token and end, as the client saw them), p50/p99 time to
first token and latency; JSON, a markdown table and a plot of tokens/s against the rate.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import pathlib
import random
import signal
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import httpx
import numpy as np

from kvjax.eval import default_text
from kvjax.testing import start_server
from kvjax_store import files

MODEL = "smollm2-135m-instruct"


# ---- workloads -----------------------------------------------------------------------


def decode_requests(tokenizer, n: int, seed: int, new=(256, 512)) -> list[dict]:
  """`n` completions: token-id prompts of 100-300 tokens of the shipped text, `new` (256 to
  512) new tokens each."""
  rng = random.Random(seed)
  ids = tokenizer.encode(default_text())
  out = []
  for _ in range(n):
    length, start = rng.randint(100, 300), rng.randrange(0, len(ids) - 400)
    out.append({"prompt": ids[start : start + length], "max_tokens": rng.randint(*new)})
  return out


def question_requests(tokenizer, n: int, seed: int) -> tuple[list[str], list[dict]]:
  """3 documents of ~2k tokens of the shipped text, each with 8 codes hidden at spread
  depths, and `n` questions over them (one code each; 24 distinct)."""
  rng = random.Random(seed)
  text = default_text()
  docs, questions = [], []
  subjects = [
      "red door", "blue box", "green key", "yellow car",
      "silver safe", "black gate", "white boat", "brown desk",
  ]  # fmt: skip
  for d in range(3):
    start = rng.randrange(0, len(text) - 12000)
    words = text[start : start + 9000].split(" ")
    codes = {s: str(rng.randint(1000, 9999)) for s in subjects}
    for i, (subject, code) in enumerate(codes.items()):
      words.insert(
          (i + 1) * len(words) // (len(codes) + 1), f"The code of the {subject} is {code}."
      )
    docs.append(" ".join(words))
    for subject, code in codes.items():
      questions.append({"doc": d, "subject": subject, "answer": code})
  rng.shuffle(questions)
  return docs, (questions * (n // len(questions) + 1))[:n]


# ---- the server ----------------------------------------------------------------------


def serve_config(config: str, args, log_path: pathlib.Path):
  """`kvjax serve` for one configuration: 'full', 'POLICY:BUDGET', 'int8', 'kvzip:F'."""
  flags = ["--kv-memory", args.kv_memory, "--rows", str(args.rows), "--queue", "4096"]
  name, _, budget = config.partition(":")
  if name == "int8":
    flags += ["--kv-dtype", "int8"]
  elif name not in ("full", "kvzip"):  # a running policy is the server's
    flags += ["--policy", name, "--budget", budget]
  return start_server(flags, log_path)


async def _one(http, url, body, t0, record, index):
  """One streamed request: time to first content, end, tokens, text."""
  start = time.perf_counter()
  first, text, usage = None, [], None
  async with http.stream("POST", url, json=body) as r:
    if r.status_code != 200:
      error = (await r.aread()).decode()[:200]
      record.append({"index": index, "status": r.status_code, "error": error})
      return
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if chunk.get("usage"):
        usage = chunk["usage"]
      for choice in chunk.get("choices", []):
        piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
        if piece and first is None:
          first = time.perf_counter()
        text.append(piece)
  end = time.perf_counter()
  record.append(
      {
          "index": index,
          "status": 200,
          "arrived": start - t0,
          "ttft": (first or end) - start,
          "latency": end - start,
          "tokens": usage["completion_tokens"] if usage else None,
          "text": "".join(text),
      }
  )


async def run_rate(url, bodies, rate, endpoint, seed):
  rng = random.Random(seed)
  record = []
  t0 = time.perf_counter()
  async with httpx.AsyncClient(timeout=3600) as http:
    tasks = []
    for index, body in enumerate(bodies):
      await asyncio.sleep(rng.expovariate(rate))
      tasks.append(asyncio.create_task(_one(http, f"{url}{endpoint}", body, t0, record, index)))
    await asyncio.gather(*tasks)
  record.sort(key=lambda r: r["index"])  # request order (they end in any order)
  return record, time.perf_counter() - t0


def most_in_flight(record) -> int:
  """The most requests generating at once: between their first token and their end, as the
  client saw them."""
  events = sorted(
      (r["arrived"] + t, step)
      for r in record
      if r["status"] == 200
      for t, step in ((r["latency"], -1), (r["ttft"], 1))
  )
  most = now = 0
  for _, step in events:
    now += step
    most = max(most, now)
  return most


def summarise(record, wall) -> dict:
  ok = [r for r in record if r["status"] == 200]

  def q(xs, p):
    return float(np.percentile(xs, p)) if xs else None

  tokens = sum(r["tokens"] or 0 for r in ok)
  return {
      "requests": len(record),
      "failed": len(record) - len(ok),
      "tokens_per_s": tokens / wall,
      "requests_per_s": len(ok) / wall,
      "most_in_flight": most_in_flight(record),
      "ttft_p50": q([r["ttft"] for r in ok], 50),
      "ttft_p99": q([r["ttft"] for r in ok], 99),
      "latency_p50": q([r["latency"] for r in ok], 50),
      "latency_p99": q([r["latency"] for r in ok], 99),
      "wall_s": wall,
  }


def bodies_for(workload, config, requests, url, docs=None):
  """Request bodies of a workload under one configuration (contexts made first for kvzip)."""
  if workload == "decode":
    return "/v1/completions", [
        {
            "model": MODEL,
            "prompt": r["prompt"],
            "max_tokens": r["max_tokens"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in requests
    ]
  name, _, budget = config.partition(":")
  ids = None
  if name == "kvzip":
    ids, start = [], time.perf_counter()
    for doc in docs:
      made = httpx.post(
          f"{url}/v1/contexts",
          json={"text": doc, "policy": "kvzip", "budget": float(budget)},
          timeout=600,
      )
      made.raise_for_status()
      ids.append(made.json()["id"])
    print(
        json.dumps({"config": config, "contexts_made_s": time.perf_counter() - start}), flush=True
    )
  out = []
  for r in requests:
    question = f"What is the code of the {r['subject']}? Answer with the number only."
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ids is not None:
      body.update(messages=[{"role": "user", "content": question}], context_id=ids[r["doc"]])
    else:
      body["messages"] = [{"role": "user", "content": docs[r["doc"]] + "\n\n" + question}]
    out.append(body)
  return "/v1/chat/completions", out


def warm_bodies(bodies) -> list[dict]:
  """Short requests that compile what the timed ones run: one prompt per power-of-two length
  bucket (prefill chunks follow it), a few at once (decode rounds of a few widths)."""
  buckets = {}
  for body in bodies:
    length = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0
    buckets.setdefault((length - 1).bit_length(), body)
  return [dict(b, max_tokens=4) for b in [*buckets.values(), *bodies[:2]]]


def accuracy(requests, record) -> float:
  """Share of the answered questions whose answer holds the code asked for."""
  ok = [(q, r) for q, r in zip(requests, record) if r["status"] == 200]
  return sum(q["answer"] in r["text"] for q, r in ok) / max(len(ok), 1)


def fidelity(record, reference) -> float:
  """Mean share of a request's text that agrees with the full cache's before they differ."""
  shares = []
  for ours, full in zip(record, reference):
    a, b = ours.get("text", ""), full.get("text", "")
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    shares.append(same / max(len(b), 1))
  return float(np.mean(shares)) if shares else 0.0


# ---- transformers' continuous batching -----------------------------------------------


def transformers_peer(
    requests, rates, kv_memory: int, seed: int, workload: str, docs=None, tokenizer=None
):
  """transformers' continuous-batching manager on the same GGUF (float32) and token ids,
  with the same Poisson arrivals; its cache sized to the same K/V memory."""
  import threading

  import torch
  import transformers

  from models import resolve_model

  path = resolve_model(MODEL).path
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32
  ).eval()
  c = model.config
  head_dim = c.hidden_size // c.num_attention_heads
  token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
  page = 16
  blocks = max(1, kv_memory // (token_bytes * page))
  if workload == "decode":
    prompts = [(r["prompt"], r["max_tokens"]) for r in requests]
  else:
    prompts = []
    for r in requests:
      question = f"What is the code of the {r['subject']}? Answer with the number only."
      text = tokenizer.apply_chat_template(
          [{"role": "user", "content": docs[r["doc"]] + "\n\n" + question}]
      )
      prompts.append((tokenizer.encode(text), 16))
  rows = {}
  for rate in rates:
    gen = transformers.GenerationConfig(
        do_sample=False, eos_token_id=-1 if workload == "decode" else None
    )
    cb = transformers.ContinuousBatchingConfig(
        num_blocks=blocks, page_size=page, max_batch_tokens=512
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    rng = random.Random(seed)
    sent, first, done = {}, {}, {}

    def collect(manager=manager, first=first, done=done):
      while len(done) < len(prompts):
        out = manager.get_result(timeout=1)
        if out is None:
          continue
        now = time.perf_counter()
        first.setdefault(out.request_id, now)
        if out.is_finished():
          done[out.request_id] = (now, list(out.generated_tokens))

    thread = threading.Thread(target=collect)
    thread.start()
    t0 = time.perf_counter()
    for i, (ids, new) in enumerate(prompts):
      time.sleep(rng.expovariate(rate))
      sent[f"r{i}"] = time.perf_counter()
      manager.add_request(ids, request_id=f"r{i}", max_new_tokens=new, streaming=True)
    thread.join()
    wall = time.perf_counter() - t0
    manager.stop(block=True, timeout=30)
    record = [
        {
            "status": 200,
            "arrived": sent[k] - t0,
            "ttft": first[k] - sent[k],
            "latency": done[k][0] - sent[k],
            "tokens": len(done[k][1]),
            "text": tokenizer.decode(done[k][1]),
        }
        for k in sent
    ]
    rows[rate] = summarise(record, wall)
    if workload == "questions":
      rows[rate]["accuracy"] = accuracy(requests, record)
    rows[rate]["record"] = record
  return rows


# ---- main ----------------------------------------------------------------------------


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workload", choices=("decode", "questions"), default="decode")
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
  parser.add_argument("--kv-memory", default="24MiB")
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--configs", nargs="+", default=["full", "h2o:192", "int8"])
  parser.add_argument("--transformers", action="store_true")
  parser.add_argument("--new-tokens", type=int, nargs=2, default=[256, 512], metavar=("MIN", "MAX"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("serve-load"))
  parser.add_argument(
      "--report",
      type=pathlib.Path,
      metavar="JSON",
      help="measure nothing: write the table and plot of a run already made",
  )
  args = parser.parse_args(argv)
  if args.report is not None:
    results = json.loads(args.report.read_text())
    for rows in [*results["kvjax"].values(), results.get("transformers", {})]:
      for row in rows.values():  # counted again from the requests where they are kept
        if "record" in row:
          row["most_in_flight"] = most_in_flight(row["record"])
    report(results, results["args"]["workload"], args.report.parent)
    return
  from models import load_decoder

  _, tokenizer = load_decoder(MODEL)
  docs = None
  if args.workload == "decode":
    requests = decode_requests(tokenizer, args.requests, args.seed, args.new_tokens)
  else:
    docs, requests = question_requests(tokenizer, args.requests, args.seed)
  args.out.mkdir(parents=True, exist_ok=True)
  results = {"args": {k: str(v) for k, v in vars(args).items()}, "kvjax": {}}
  for config in args.configs:
    proc, url = serve_config(config, args, args.out / f"server-{config.replace(':', '_')}.log")
    try:
      endpoint, bodies = bodies_for(args.workload, config, requests, url, docs)
      # Untimed: the first requests compile the steps (both sides warm before timing).
      asyncio.run(run_rate(url, warm_bodies(bodies), 100.0, endpoint, 1))
      for rate in args.rates:
        record, wall = asyncio.run(run_rate(url, bodies, rate, endpoint, args.seed))
        row = summarise(record, wall)
        if args.workload == "questions":
          row["accuracy"] = accuracy(requests, record)
        row["record"] = record
        results["kvjax"].setdefault(config, {})[rate] = row
        print(
            json.dumps(
                {"config": config, "rate": rate, **{k: v for k, v in row.items() if k != "record"}}
            ),
            flush=True,
        )
    finally:
      proc.send_signal(signal.SIGTERM)
      proc.wait(120)
  if args.workload == "decode" and "full" in results["kvjax"]:
    for config, rows in results["kvjax"].items():
      for rate, row in rows.items():
        row["fidelity"] = fidelity(row["record"], results["kvjax"]["full"][rate]["record"])
  if args.transformers:
    results["transformers"] = transformers_peer(
        requests,
        args.rates,
        _bytes(args.kv_memory),
        args.seed,
        args.workload,
        docs,
        tokenizer,
    )
  files.write_text(args.out / f"{args.workload}.json", json.dumps(results, indent=1, default=str))
  report(results, args.workload, args.out)


def report(results: dict, workload: str, out: pathlib.Path) -> None:
  """`WORKLOAD.md` (the table) and `WORKLOAD.png` (tokens/s against arrival rate, one line
  per configuration) beside the JSON, each written atomically."""
  table = _table(results, workload)
  files.write_text(out / f"{workload}.md", table + "\n")
  print(table)
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot", file=sys.stderr)
    return
  sides = [(f"kvjax {c}", rows) for c, rows in results["kvjax"].items()]
  if "transformers" in results:
    sides.append(("transformers CB (full)", results["transformers"]))
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, rows in sides:
    rates = sorted(rows, key=float)
    ax.plot([float(r) for r in rates], [rows[r]["tokens_per_s"] for r in rates], "o-", label=name)
  ax.set_xscale("log")
  ax.set_xlabel("arrival rate (requests/s, Poisson)")
  ax.set_ylabel("generated tokens/s")
  ax.set_ylim(bottom=0)
  ax.grid(True, which="both", alpha=0.3)
  ax.set_title(
      f"kvjax serve, {workload} workload, {results['args']['requests']} requests per rate,\n"
      f"--kv-memory {results['args']['kv_memory']} (transformers: the same K/V bytes)",
      fontsize=9,
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  # Rendered to bytes and written atomically (a symlink planted at the path is replaced,
  # never followed).
  image = io.BytesIO()
  fig.savefig(image, format="png", dpi=110)
  plt.close(fig)
  files.write_bytes(out / f"{workload}.png", image.getvalue())


def _bytes(text: str) -> int:
  """'24MiB' -> bytes (the units `kvjax serve --kv-memory` takes)."""
  units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
  for unit, factor in units.items():
    if text.lower().endswith(unit):
      return int(float(text[: -len(unit)]) * factor)
  return int(text)


def _table(results, workload) -> str:
  head = (
      "| configuration | rate (req/s) | tokens/s | requests/s | most in flight "
      "| TTFT p50 / p99 (s) | latency p50 / p99 (s) |"
  )
  extra = " accuracy |" if workload == "questions" else " fidelity |"
  lines = [head + extra, "|---|---:|---:|---:|---:|---:|---:|---:|"]
  sides = [(f"kvjax {c}", rows) for c, rows in results["kvjax"].items()]
  if "transformers" in results:
    sides.append(("transformers CB", results["transformers"]))
  for name, rows in sides:
    for rate, r in rows.items():
      score = r.get("accuracy", r.get("fidelity"))
      lines.append(
          f"| {name} | {rate} | {r['tokens_per_s']:.1f} | {r.get('requests_per_s', 0):.2f} "
          f"| {r['most_in_flight'] if r.get('most_in_flight') is not None else '-'} "
          f"| {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['latency_p50']:.1f} / {r['latency_p99']:.1f} "
          f"| {'-' if score is None else f'{score:.3f}'} |"
      )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
