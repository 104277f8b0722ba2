"""Batched generation: prompts of different lengths in one batch, sampled, then streamed.

python examples/generate_batch.py
"""

import kvjax
import models

model, tokenizer = models.load_llama()
prompts = [
    "Give me three tips for writing clear code.",
    "What is 12 times 12?",
    "Write a two-line poem about the ocean.",
]

# Ragged prompts share one batch; each row stops at EOS or max_new_tokens on its own.
result = kvjax.generate(
    model,
    tokenizer,
    prompts,
    chat=True,
    max_new_tokens=48,
    sampling=kvjax.Sampling(temperature=0.7, top_p=0.9),
    seed=0,
)
for prompt, text, reason in zip(prompts, result.texts, result.finish_reasons):
  print(f"## {prompt}\n{text}\n[{reason}]\n")
print({k: result.stats[k] for k in ("prompt_tokens", "generated_tokens", "decode_tokens_per_s")})

# Streaming: one event per token as it is generated.
print("\n## streamed:")
for event in kvjax.generate(model, tokenizer, ["Count from 1 to 5."], chat=True, stream=True):
  print(event.text, end="", flush=True)
print()
