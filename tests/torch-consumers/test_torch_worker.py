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


SHARES = r"""
import os, sys
os.environ["RELAX_ROLE"] = "trainer"
sys.path.insert(0, {scripts!r})
import torch
import torch_worker as tw

tw.init({{"api": "cuda", "device": 0, "shape": {{"vocab": 16, "context": 24, "hidden": 32}}, "seed": 3,
          "memory": [], "loss": {{"clip": {{"eps_low": 0.2, "eps_high": 0.28, "dual": 3.0}}, "kl_kind": "k3",
                                  "kl_coef": 0.1, "entropy_coef": 0.01}}, "adam": {{"lr": 1e-3}}}})
g = torch.Generator().manual_seed(0)
rand = lambda n, lo, hi: (torch.rand(n, generator=g) * (hi - lo) + lo).tolist()
samples = []
for i in range(7):  # ragged: prompts of 2 to 4 tokens, responses of 1 to 5
    n = 1 + (i * 3) % 5
    samples.append({{"prompt": torch.randint(1, 16, (2 + i % 3,), generator=g).tolist(),
                     "response": torch.randint(1, 16, (n,), generator=g).tolist(),
                     "advantages": rand(n, -1, 1), "old_logprobs": rand(n, -3, -1), "ref_logprobs": rand(n, -3, -1)}})
params = list(tw.state["model"].parameters())
tokens, seqs = sum(len(s["response"]) for s in samples), len(samples)


def grads_of(parts):
    for w in params:
        w.grad.zero_()
    stats = {{}}
    for part in parts:
        loss, st = tw.minibatch_loss(part, tokens, seqs)
        loss.backward()
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + float(v)
    return [w.grad.clone() for w in params], stats


worst = 0.0
for how in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
    tw.state["loss"]["aggregation"] = how
    whole, s1 = grads_of([samples])
    # Two ranks' shares, as minibatch_step deals them: rank r takes samples[r::2].
    shared, s2 = grads_of([samples[0::2], samples[1::2]])
    worst = max(worst, max((a - b).abs().max().item() for a, b in zip(whole, shared)))
    assert max(abs(a.abs().max().item()) for a in whole) > 0, "the loss has gradients"
    assert all(abs(s1[k] - s2[k]) < 1e-5 for k in s1), (how, s1, s2)
assert worst < 1e-5, worst
print("worst_grad_diff=%g" % worst)
"""


def test_data_parallel_shares_add_up_to_the_whole_minibatch(sim):
    """The trainers' data parallelism (init's `trainer_group`): each rank's share of a minibatch
    is normalized by the whole minibatch's tokens or sequences, so the shares' gradients and
    statistics, summed as the all-reduce sums them, are the whole minibatch's under every
    aggregation; a rank's share is never averaged on its own."""
    out = sim.ok(SHARES.format(scripts=str(SCRIPTS)), preload=sim.hook, extra={"OMP_NUM_THREADS": "1"})
    assert float(out["worst_grad_diff"]) < 1e-5
