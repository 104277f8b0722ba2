# Ran on kvjax at c536944, the commit that recorded its output
# (protected_answers_kvzip_0.125.txt); last edited at 28dcd67, after 754040c, which only
# renamed its kvjax imports; not re-run since. It imports kvjax internals, which may move again.
"""Passkey answers at a budget with the needle protected by hand (an oracle):
  PYTHONPATH=. python protected_answers.py POLICY BUDGET needle|none"""
import sys, numpy as np, json
from models.llama import load_llama
import kvjax
from kvjax.eval import _tasks, _data
from kvjax.runtime.prompts import Segment
from kvjax.runtime.session import prefill
model, tok = load_llama()
cases = _tasks.passkey_cases(tok, 2048, depths=(0.1,0.25,0.4,0.55,0.7,0.85), trials=4, fillers=("text",))
policy = sys.argv[1]; budget = float(sys.argv[2]); mode = sys.argv[3]  # mode: digits|needle|none
hits = 0
for i, c in enumerate(cases):
  ids = c['ids']
  needle = tok.encode(_data.PASSKEY_NEEDLE.format(key=c['answer']))
  pos = [j for j in range(len(ids)-len(needle)+1) if ids[j:j+len(needle)] == needle][0]
  opening, _ = _answers.chat_parts(tok, True)
  q = _answers.encode_question(tok, c['question'], True)
  spec = _answers.at_budget(kvjax.CompressionSpec(policy=policy, budget=budget), _answers.request_tokens(tok, ids, [q], True))
  if mode == "needle":
    segs = [Segment(opening, protected=True), Segment(ids[:pos]), Segment(needle, protected=True), Segment(ids[pos+len(needle):])]
  else:
    segs = [Segment(opening, protected=True), Segment(ids)]
  state = prefill(model, [segs], spec, tokenizer=tok, reserve=len(q)+12, seed=0)
  text = _answers.ask(model, tok, state, q, max_new_tokens=12, donate=True)[0]
  ok = _tasks._first_number(text) == c['answer']
  hits += ok
  print(i, c['depth'], ok, repr(text[:50]), flush=True)
print("correct", hits, "/", len(cases))
