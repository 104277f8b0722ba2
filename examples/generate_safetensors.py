"""Generate from a local Hugging Face checkpoint directory (config.json + *.safetensors +
tokenizer.json), e.g. a Llama, Mistral, Qwen2 or SmolLM2 download you already have.

    python examples/generate_safetensors.py /path/to/checkpoint "Your prompt"

Nothing is downloaded: the directory must already exist on disk.
"""

import sys

import jax.numpy as jnp

import kvjax
import models

if len(sys.argv) < 2:
  sys.exit(__doc__)
checkpoint = sys.argv[1]
prompt = sys.argv[2] if len(sys.argv) > 2 else "Tell me about paged attention."

model, tokenizer = models.load_llama(checkpoint, dtype=jnp.float32)  # bfloat16 halves memory
chat = tokenizer.chat_template is not None
result = kvjax.generate(model, tokenizer, [prompt], chat=chat, max_new_tokens=64)
print(result.texts[0])
