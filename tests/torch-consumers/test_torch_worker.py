"""scripts/torch_worker.py's rollout `generate` as the async runner drives it (partial rollouts,
docs/worker-protocol.md), called in-process on a simulated device under the hook: a segment
stops after `segment_tokens` new tokens and says which sequences finished; a sequence sent back
with its tokens continues after them, its new tokens' log-probs those of the whole sequence
scored at once under the same weights (so the prefix really conditions what follows); without
either parameter a request generates what it did before they existed. Its modelled device time
is charged as the runner's ComputeModel charges it, and a budget of modelled decoding
(`segment_s`) cuts a segment mid-token, the steps done carried in `progress`.

Its trainers as data-parallel ranks (init's `trainer_group`): each rank's share of a minibatch
adds up to the whole one (importance weights included; weights of 1 are none, 0 removes a token's
policy gradient, a bad weight list is refused naming the field), and two ranks in a process group
stay replicas, a train step with their communicators suspended failing with NCCL's error."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# torch_worker.py imports the runner's worker-protocol client (relax_worker), which the runner puts
# on its workers' PYTHONPATH; called in-process here, it comes from the runner's sources.
RUNNER_PYTHON = str(SCRIPTS.parent / "relax-colocate" / "python")


@pytest.fixture
def sim(sim):
    sim.python_path.append(RUNNER_PYTHON)
    return sim

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


CHARGE = r"""
import sys
sys.path.insert(0, {scripts!r})
import torch_worker as tw

# Qwen3-4B on an H100's datasheet figures, as relax-colocate's protocol tests model it.
block = {{"forward_flops_per_token": 8e9, "tflops": 989.0, "train_mfu": 0.4, "rollout_mfu": 0.3,
          "token_scale": 1.0, "trainers": 1.0, "hbm_gbps": 3350.0, "weight_bytes": 8e9,
          "kv_bytes_per_token": 147456.0, "decode_step_ms": 2.0}}
tw.state["compute"] = dict(block)
print("one_step=%r" % tw.decode_s([(0, 1)]))
tw.state["compute"] = dict(block, token_scale=300.0)
print("scaled=%r" % tw.decode_s([(4, 3), (4, 1)]))
# A request's own token_scale (compute.token_scale_final) charges as init's would at that scale.
tw.serve_scale({{"token_scale": 600.0}})
print("request_scaled=%r" % tw.decode_s([(4, 3), (4, 1)]))
tw.serve_scale({{}})
tw.state["compute"] = dict(block, token_scale=600.0)
print("init_scaled=%r" % tw.decode_s([(4, 3), (4, 1)]))
del block["decode_step_ms"]
tw.state["compute"] = dict(block, token_scale=300.0)
print("scaled_without=%r" % tw.decode_s([(4, 3), (4, 1)]))
"""


def test_decode_is_charged_as_the_runner_models_it(sim):
    """torch_worker.py charges a decode step as ComputeModel::decode_step_seconds does: one
    sequence at an empty context reads the weights and half a token of KV at `hbm_gbps`, then
    pays `decode_step_ms` (the Rust unit test pins the same figure); each task step stands for
    `token_scale` modelled steps, each paying it whatever the batch; a block without the key (an
    older runner) pays the roofline alone."""
    out = sim.ok(CHARGE.format(scripts=str(SCRIPTS)), preload=sim.hook, extra={"OMP_NUM_THREADS": "1"})
    assert abs(float(out["one_step"]) - (8e9 / 3350e9 + 147456 * 0.5 / 3350e9 + 0.002)) < 1e-12, out
    # Three task steps (one with two sequences, two with one), 300 modelled steps each, 2 ms each.
    extra = float(out["scaled"]) - float(out["scaled_without"])
    assert abs(extra - 3 * 300 * 0.002) < 1e-9, out
    assert float(out["request_scaled"]) == float(out["init_scaled"]) > float(out["scaled"]), out


BUDGET = r"""
import json, os, sys
os.environ["RELAX_ROLE"] = "rollout"
sys.path.insert(0, {scripts!r})
import torch_worker as tw

tw.init({{"api": "cuda", "device": 0, "shape": {{"vocab": 16, "context": 24, "hidden": 32}}, "seed": 3,
          "memory": [], "max_batch": 4}})
tw.state["compute"] = {{"forward_flops_per_token": 8e9, "tflops": 989.0, "train_mfu": 0.4, "rollout_mfu": 0.3,
                        "token_scale": 10.0, "trainers": 1.0, "hbm_gbps": 3350.0, "weight_bytes": 8e9,
                        "kv_bytes_per_token": 147456.0, "decode_step_ms": 2.0}}
prompts = [[1, 2, 3, 4], [5, 6, 7]]
base = {{"prompts": prompts, "n": 2, "max_new_tokens": 8, "temperature": 1.0, "seed": 11, "segment_tokens": 3}}
free = tw.generate(base)["samples"]
# The first task step of the four fresh sequences, then the second at their grown contexts.
first = tw.decode_s([(4, 1), (4, 1), (3, 1), (3, 1)])
second = tw.decode_s([(5, 1), (5, 1), (4, 1), (4, 1)])
cut = tw.generate(dict(base, segment_s=first + 0.5 * second))["samples"]
print("cut=%s" % json.dumps(cut))
print("free=%s" % json.dumps(free))
print("want_progress=%r" % (10.0 * 0.5))
# A sequence 5 steps into its next token pays for the other 5 only.
whole = tw.paced_decode([(4, 2)], [], None)[0]
carried = tw.paced_decode([(4, 2)], [5.0], None)[0]
print("saved=%r" % (whole - carried))
print("half_step=%r" % (0.5 * tw.decode_s([(4, 1)])))
"""


def test_a_segment_budget_cuts_mid_token_and_carries_the_steps(sim):
    """With modelled compute, `segment_s` ends a request part-way through a token: each sequence
    keeps the tokens the budget paid for (a prefix of what it generated without one) and says the
    modelled steps it did towards the next, which a later request's `progress` does not charge
    again."""
    out = sim.ok(BUDGET.format(scripts=str(SCRIPTS)), preload=sim.hook, extra={"OMP_NUM_THREADS": "1"})
    cut, free = json.loads(out["cut"]), json.loads(out["free"])
    assert [len(s["response"]) for s in free] == [3] * 4, free
    for c, f in zip(cut, free):
        assert c["response"] == f["response"][:1] and c["logprobs"] == f["logprobs"][:1], (c, f)
        assert not c["finished"] and abs(c["progress"] - float(out["want_progress"])) < 1e-6, c
    assert abs(float(out["saved"]) - float(out["half_step"])) < 1e-12, out


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
    if i % 2:  # the off-policy correction's weights on some samples, none (all 1) on the others
        samples[-1]["is_weights"] = rand(n, 0, 2)
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

# Weights of 1 are no weights; weights of 0 leave no policy gradient (with the KL and entropy
# terms off, no gradient at all); a weight scales its token's term.
tw.state["loss"]["aggregation"] = "token-mean"
plain = [{{k: v for k, v in s.items() if k != "is_weights"}} for s in samples]
weighted = lambda w: [dict(s, is_weights=[w] * len(s["response"])) for s in plain]  # noqa: E731
g_plain, st_plain = grads_of([plain])
g_ones, st_ones = grads_of([weighted(1.0)])
assert all(torch.equal(a, b) for a, b in zip(g_plain, g_ones)) and st_ones["tis_weight_mean"] == 1.0, st_ones
tw.state["loss"].update(kl_coef=0.0, entropy_coef=0.0)
g_zero, st_zero = grads_of([weighted(0.0)])
assert st_zero["pg_loss"] == 0.0 and st_zero["tis_weight_mean"] == 0.0, st_zero
assert all(not g.any() for g in g_zero), "a weight of 0 left a gradient"
g_one, _ = grads_of([plain])
g_half, _ = grads_of([weighted(0.5)])
assert all(torch.allclose(0.5 * a, b, atol=1e-7) for a, b in zip(g_one, g_half)), "a weight does not scale"

# A weight list of the wrong length is a bad request naming the field, before any training.
bad = dict(plain[0], is_weights=[1.0] * (len(plain[0]["response"]) + 1))
try:
    tw.train({{"samples": [plain[1], bad], "minibatches": 1}})
    raise AssertionError("a bad is_weights was trained on")
except tw.rw.WorkerError as e:
    assert e.kind == "bad_request" and e.message.startswith("train sample 1: is_weights has"), e.message
print("worst_grad_diff=%g" % worst)
"""


def test_data_parallel_shares_add_up_to_the_whole_minibatch(sim):
    """The trainers' data parallelism (init's `trainer_group`): each rank's share of a minibatch
    is normalized by the whole minibatch's tokens or sequences, so the shares' gradients and
    statistics, summed as the all-reduce sums them, are the whole minibatch's under every
    aggregation; a rank's share is never averaged on its own."""
    out = sim.ok(SHARES.format(scripts=str(SCRIPTS)), preload=sim.hook, extra={"OMP_NUM_THREADS": "1"})
    assert float(out["worst_grad_diff"]) < 1e-5


RANK = r"""
import json, os, sys
os.environ["RELAX_ROLE"] = "trainer"
sys.path.insert(0, {scripts!r})
import torch
import tms
import torch_worker as tw

rank = int(os.environ["RANK"])
group = {{"backend": "nccl", "init_method": os.environ["INIT_METHOD"], "rank": rank, "world": 2}}
# Each rank its own seed: the broadcast of rank 0's weights is what makes them replicas.
tw.init({{"api": "cuda", "device": rank, "shape": {{"vocab": 16, "context": 24, "hidden": 32}}, "seed": 3 + rank,
          "memory": [], "loss": {{"clip": {{"eps_low": 0.2, "eps_high": 0.28}}, "kl_coef": 0.1}},
          "adam": {{"lr": 1e-2}}, "trainer_group": group}})
g = torch.Generator().manual_seed(0)
samples = []
for i in range(5):
    n = 1 + i % 3
    samples.append({{"prompt": torch.randint(1, 16, (3,), generator=g).tolist(),
                     "response": torch.randint(1, 16, (n,), generator=g).tolist(),
                     "advantages": [(-1.0) ** i] * n, "old_logprobs": [-2.0] * n, "ref_logprobs": [-2.0] * n}})
batch = {{"samples": samples, "minibatches": 2, "epochs": 1}}
out = {{"start": tw.checksum({{}})["weights"]}}
out["trained"] = (tw.train(batch)["grad_norm"], tw.checksum({{}})["weights"])
out["paused"] = tms.pause_report("nccl")["bytes_done"]
try:
    tw.train(batch)
    out["while_suspended"] = "trained"
except Exception as e:
    out["while_suspended"] = f"{{type(e).__name__}}: {{e}}"
out["unchanged"] = tw.checksum({{}})["weights"]
tms.resume_report("nccl")
out["resumed"] = (tw.train(batch)["grad_norm"], tw.checksum({{}})["weights"])
print("@" + json.dumps(out), flush=True)
"""


def test_data_parallel_trainers_stay_replicas_and_refuse_to_train_suspended(sim, tmp_path):
    """Two torch_worker.py trainers in one process group (init's `trainer_group`, as the runner
    sends it), each on its device: rank 0's weights reach rank 1 at init although their seeds
    differ; after a train step both hold the same weights. With the communicators suspended
    (tag `nccl`) a train step fails at its gradient all-reduce with NCCL's error, never a hang,
    the weights untouched; resumed, both train again to the same weights. So a collective while
    suspended cannot pass unnoticed: the runner must resume first, and does (test
    the_colocated_cycle_suspends_the_trainers_process_group)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(scripts=str(SCRIPTS)))
    port = 29500 + (os.getpid() * 17 + int(time.time())) % 20000
    procs = []
    for rank in range(2):
        extra = {"RANK": str(rank), "INIT_METHOD": f"tcp://127.0.0.1:{port}", "OMP_NUM_THREADS": "1",
                 "TMS_SIM_NCCL_CONNECT_TIMEOUT": "60"}
        env = sim.env(devices=2, memory="2GiB", preload=sim.hook, extra=extra)
        env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], str(SCRIPTS.parent / "python")])
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        text, _ = p.communicate(timeout=240)
        assert p.returncode == 0, text
        outs.append(json.loads(next(line[1:] for line in text.splitlines() if line.startswith("@"))))
    r0, r1 = outs
    assert r0["start"] == r1["start"], "rank 0's weights were not broadcast at init"
    assert r0["trained"] == r1["trained"] and r0["trained"][1] != r0["start"], outs
    assert r0["paused"] == r1["paused"] == 16 << 20, outs
    for r in outs:
        assert "invalid usage" in r["while_suspended"].lower(), r["while_suspended"]
        assert r["unchanged"] == r["trained"][1], r
    assert r0["resumed"] == r1["resumed"] and r0["resumed"][1] != r0["trained"][1], outs
