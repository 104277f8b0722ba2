"""A session's state on disk: compress a context once, answer from it many times, in another
process or on another day.

    state = kvjax.prefill(model, [document_ids], spec, tokenizer=tokenizer)
    kvjax.save_state("doc.kvjax", state, model, tokenizer=tokenizer, tokens=[document_ids])
    ...                                                   # another process
    state = kvjax.load_state("doc.kvjax", model, tokenizer=tokenizer)
    state, result = kvjax.decode(model, kvjax.extend(model, state, [question_ids]), 32)

A state directory keeps complete versions and names the current one:

    DIR/CURRENT     the current version's name, replaced atomically (write + rename)
    DIR/.lock       what a save locks (`fcntl.flock`) from its checks to its clean-up, so
                    saves into one directory run one after another
    DIR/v<N>/       an orbax-checkpoint composite checkpoint (orbax writes it to a temporary
                    directory and renames it when complete):
      arrays/       StandardSave: the live pages only (k, v and the per-slot arrays, in page
                    table order), the page table, lengths, logits, positions, sampling key
      meta/         JsonSave: format, kvjax version, model and tokenizer fingerprints, the
                    CompressionSpec (a head allocation by value) and cache plan, the prefilled
                    token ids, and a SHA-256 digest of all of it and of every array

A save keeps the version CURRENT named before it (a reader may be reading it) and removes
older ones; a reader whose version was removed under it (two saves during one read) reads
CURRENT again and retries. A process killed while saving leaves CURRENT naming the previous
complete version (or no CURRENT at all for a first save: nothing loads); the next save clears
what it left. A load checks the format, the model, its dtype and the tokenizer, then the
arrays the checkpoint declares against what its metadata implies (before any is read), the
digest, and the page table (`_checks`), before any array reaches the device: a corrupted,
foreign or edited checkpoint is a `StateFileError` (a `ValueError`), never a state.
`state_info` runs the same checks but those that need the model. The digest catches
accidents, not an attacker (anyone can recompute a SHA-256 after an edit): the structural
checks are what refuse an edited state. Everything a save writes is private (files 0600,
directories 0700), and no link in a state directory is followed.
"""

from kvjax.persistence._directory import CURRENT, current_version
from kvjax.persistence._format import FORMAT, StateFileError, tokenizer_fingerprint
from kvjax.persistence._load import load_state, state_info
from kvjax.persistence._save import save_state

__all__ = [
    "CURRENT",
    "FORMAT",
    "StateFileError",
    "current_version",
    "load_state",
    "save_state",
    "state_info",
    "tokenizer_fingerprint",
]
