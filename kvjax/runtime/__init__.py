"""The runtime: states, the compiled steps that read prompts into a cache and decode from
it, and the session API over them (`kvjax.prefill`, `decode`, `extend`, `fork`, `ask`,
`generate` are its public face, exported by `kvjax`).

    prompts      prompts as kvjax takes them (text, ids, `Segment`s, chats) and their
                 encoding: a context and the question read after it
    tokenizer    the tokenizer contract (`TokenizerLike`) and `as_tokenizer`'s adapters
    sampling     `Sampling`: greedy, temperature, top-k/top-p, as traced values
    state        `State` (a pytree: cache, logits, positions, key) and `DecodeResult`
    compilation  compiled steps: kept in the process, stored on disk, compiled ahead
    steps        the compiled prefill chunk and decode loop, and the host loops around them
    pool         a state's page pool, grown or compacted on the host between steps
    session      `prefill`, `extend`, `decode`, `fork`
    generation   `generate` (a context, a question, the answer, in one call; streaming)
                 and `ask` (a question about a prefilled state)
    warmup       `warmup`: fills the compiled-step store for the shapes a deployment sees
"""
