"""Batch-1 and batch-6 decode of whatever guidespec is first on the path, for comparing two
checkouts in alternation on a drifting host (issue 47's "batch-1 decode unchanged"):

    for i in 1 2 3 4; do for tree in ../before .; do
        (cd $tree && PYTHONPATH=$PWD python benchmarks/decode_tree.py); done; done

3 chat prompts x 128 tokens (EOS ignored) one at a time, then the 3 twice at once; the default
engine; prints the tree it ran and tok/s as JSON.
"""

import json
import sys
import time

from guidespec import LLM, SamplingParams
import guidespec

print("from", guidespec.__file__, file=sys.stderr)
prompts = [
    [{"role": "user", "content": q}]
    for q in (
        "Write a long story about a dragon.",
        "Explain how compilers work in detail.",
        "Describe the history of Rome.",
    )
]
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
with LLM(max_batch_size=4, show_progress=False) as llm:
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0.0))
    rates = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate(p, params)[0]
        dt = time.perf_counter() - t
        rates.append(len(out.token_ids) / dt)
    t = time.perf_counter()
    outs = llm.generate(prompts * 2, params)
    dt = time.perf_counter() - t
    b6 = sum(len(o.token_ids) for o in outs) / dt
print(json.dumps({"batch1_tok_s": round(sum(rates) / len(rates), 2), "batch6_tok_s": round(b6, 2)}))
