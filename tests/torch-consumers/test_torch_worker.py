"""scripts/torch_worker.py's rollout `generate` as the async runner drives it (partial rollouts,
docs/worker-protocol.md), called in-process on a simulated device under the hook: a segment
stops after `segment_tokens` new tokens and says which sequences finished; a sequence sent back
with its tokens continues after them, its new tokens' log-probs those of the whole sequence
scored at once under the same weights (so the prefix really conditions what follows); without
either parameter a request generates what it did before they existed."""

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

SCENARIO = r"""
import os, sys
os.environ["RELAX_ROLE"] = "rollout"
sys.path.insert(0, {scripts!r})
import torch
import torch_worker as tw

VOCAB, CONTEXT, MAX_NEW = 16, 24, 8
tw.init({{"api": "cuda", "device": 0, "shape": {{"vocab": VOCAB, "context": CONTEXT, "hidden": 32}}, "seed": 3,
          "memory": [], "max_batch": 4}})
prompts = [[1, 2, 3, 4], [5, 6, 7]]
base = {{"prompts": prompts, "n": 2, "max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": 11}}

# No eos: every sequence runs to max_new_tokens, so segments and finished are exact.
whole = tw.generate(base)["samples"]
assert [s["prompt_index"] for s in whole] == [0, 0, 1, 1], whole
assert all(len(s["response"]) == MAX_NEW and s["finished"] for s in whole), whole
assert tw.generate(dict(base))["samples"] == whole, "the same seed samples the same"

seg = tw.generate(dict(base, segment_tokens=3))["samples"]
assert all(len(s["response"]) == 3 and not s["finished"] for s in seg), seg

# Continue every sequence after its 3 tokens, one prompt per sequence as the runner sends them,
# in one-token then five-token segments; the last reaches max_new_tokens and finishes.
seqs = [(prompts[s["prompt_index"]], list(s["response"])) for s in seg]
cont = {{"prompts": [p for p, _ in seqs], "n": 1, "max_new_tokens": MAX_NEW, "temperature": 0.7, "seed": 5}}
one = tw.generate(dict(cont, responses=[r for _, r in seqs], segment_tokens=1))["samples"]
assert [s["prompt_index"] for s in one] == [0, 1, 2, 3], one
assert all(len(s["response"]) == 1 and not s["finished"] for s in one), one
for (_, r), s in zip(seqs, one):
    r.extend(s["response"])
rest = tw.generate(dict(cont, responses=[r for _, r in seqs], segment_tokens=5, seed=6))["samples"]
assert all(len(s["response"]) == MAX_NEW - 4 and s["finished"] for s in rest), rest

# The continued tokens' log-probs are the model's for the whole sequence at once.
model = tw.state["model"]
worst = 0.0
for (p, r), s in zip(seqs, rest):
    full = torch.tensor([p + r + s["response"]], device=tw.state["device"])
    with torch.no_grad():
        logp = torch.log_softmax(model(full)[0].float() / 0.7, dim=-1)
    start = len(p) + len(r)
    want = [logp[start + t - 1, tok].item() for t, tok in enumerate(s["response"])]
    worst = max(worst, max(abs(a - b) for a, b in zip(want, s["logprobs"])))
assert worst < 1e-4, worst

# EOS ends a sequence before the segment does.
r = whole[0]["response"]
eos = tw.generate(dict(base, eos=r[1], segment_tokens=6))["samples"][0]
assert eos["response"] == r[:r.index(r[1]) + 1] and eos["finished"], eos
print("worst_logprob_diff=%g" % worst)
"""


def test_generate_continues_prefixes_in_segments(sim):
    out = sim.ok(SCENARIO.format(scripts=str(SCRIPTS)), preload=sim.hook, extra={"OMP_NUM_THREADS": "1"})
    assert float(out["worst_logprob_diff"]) < 1e-4
