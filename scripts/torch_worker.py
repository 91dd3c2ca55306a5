#!/usr/bin/env python3
"""A PyTorch worker for `relax-colocate run` (docs/worker-protocol.md), both roles.

    relax-colocate run --trainer-cmd 'python3 scripts/torch_worker.py' \
                       --rollout-cmd 'python3 scripts/torch_worker.py'

Everything lives in real CUDA tensors made by PyTorch's caching allocator under the preloaded
libtms_hook.so, the way a framework's do: a small decoder-only transformer built in code (token and
position embeddings, pre-norm attention blocks, a tied output head), tagged with the `tms`
package's regions (one MemPool per tag):

- trainer: "weights" (the actor), "ref" (the frozen initial policy), "grads" (made up front, so
  backward accumulates into them), "optimizer" (AdamW's moments, made up front), all with CPU
  backup; activations are outside any region and the cache is emptied after each method, as
  frameworks do before they sleep;
- rollout: "weights", "kv_cache" (keys and values of every layer for `max_batch` sequences
  over the whole context; sampling decodes incrementally through it) and "cuda_graph" (the
  captured sampling head that every decode step replays), no backup.

The runner puts the trainer to sleep before `update_weights` (docs/worker-protocol.md), so the
trainer packs from a host snapshot of its weights (pinned memory, outside any region) taken after
`init` and after every `train`.

Several trainers (colocate mode on several devices) are data-parallel ranks: `init`'s
`trainer_group` makes them a torch.distributed "nccl" process group, rank 0's weights are
broadcast to the others as DDP does at start (which also makes the communicator, before the first
sleep), and `train` gives each rank its share of every minibatch and all-reduces the gradients, so
the replicas stay identical. NCCL allocates its buffers outside any region; the runner suspends
them with the trainer's other memory (tag `nccl`) and resumes them before the next request.

Training is GRPO's clipped surrogate (dual clip optional), each token's term weighted by the
off-policy correction's importance weight when the runner sends one (`is_weights`; async mode's
truncated importance sampling, docs/async.md), with the k1/k2/k3 KL to the reference in the
loss, the three aggregations, minibatches, epochs, gradient clipping and AdamW. The weights
cross to the rollout through the runner's shared file, one bucket at a time, staged in a device
buffer outside any region, or with `--weight-transport ipc` (and for elastic mode's lends) through a
device buffer of the trainer's that the rollout on its device opens by CUDA IPC handle, no host
copy between them. PPO (a value head) is not implemented: `values` is refused.

In async mode (`relax-colocate run --mode async`, docs/async.md) the same worker is the trainer on
devices of its own and the rollout engines on others. The rollout does partial rollouts: it
generates at most `segment_tokens` tokens per sequence a request, and a sequence sent back with the
tokens it has (`responses`) continues after them under the weights it holds now, its prompt and
prefix prefilled again. With `compute.model` every request lasts at least the modelled device
time, as the built-in workers' do. The weights go by broadcast there: the first trainer and the
engines form a torch.distributed NCCL group of their own (`group_id`, `group_init`), and each
update is broadcast from the trainer in buckets (`broadcast_weights`); the hello names the
`broadcast` transport, so the runner's `auto` picks it.

On tms-sim the kernels run on the CPU (tms-sim/python's compute layer); on a GPU this is an
ordinary PyTorch program. Needs torch and the `tms` package (the wheel, or python/ of this
repository, which is found next to this script), and the runner's relax_worker.py with the compute
model's figures beside it (relax_compute_model.json, which relax-colocate gives its workers).
"""

import atexit
import ctypes
import hashlib
import json
import math
import mmap
import os
import socket
import sys
import time

# The runner's worker-protocol client: relax-colocate puts it on this process's PYTHONPATH
# (docs/worker-protocol.md).
import relax_worker as rw

here = os.path.dirname(os.path.abspath(__file__))


def load_figures():
    """The compute model's figures (passes and MFU per stage, the decode step's KV midpoint, the
    token tolerance), stated once for this worker and the runner: relax-colocate gives its workers
    relax_compute_model.json beside relax_worker.py, and scripts/install.sh installs the two side by
    side."""
    with open(os.path.join(os.path.dirname(os.path.abspath(rw.__file__)), "relax_compute_model.json")) as f:
        return json.load(f)


FIGURES = load_figures()

try:
    import tms  # noqa: F401
except ImportError:  # a source checkout: python/ beside scripts/
    sys.path.insert(1, os.path.join(os.path.dirname(here), "python"))
import tms  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from datetime import timedelta  # noqa: E402

HEADS = 4
LAYERS = 2
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

state = {}


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x, cache=None, pos=0):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, HEADS, h // HEADS).transpose(1, 2) for z in (q, k, v))
        if cache is not None:  # cache: [2, max_batch, heads, context, head_dim]
            cache[0, :b, :, pos:pos + t] = k
            cache[1, :b, :, pos:pos + t] = v
            k, v = cache[0, :b, :, :pos + t], cache[1, :b, :, :pos + t]
        # A prefill (pos 0) is causal; a decode step attends to everything cached.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=pos == 0)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Policy(torch.nn.Module):
    def __init__(self, vocab, context, hidden):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(context, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(LAYERS))
        self.ln = torch.nn.LayerNorm(hidden)
        # Embedding's default N(0, 1) through the tied head gives logits of about sqrt(hidden):
        # a policy that is deterministic from the start, so every GRPO group is one repeated
        # answer with zero advantage. GPT-style small initial weights keep it exploring.
        for table in (self.tok, self.pos):
            torch.nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens, kv=None, pos=0):
        x = self.tok(tokens) + self.pos(torch.arange(pos, pos + tokens.shape[1], device=tokens.device))
        for i, block in enumerate(self.blocks):
            x = block(x, None if kv is None else kv[i], pos)
        return self.ln(x) @ self.tok.weight.t()


def weight_tensors(model):
    """The weights stream's order: the state dict's, which both sides build the same way."""
    return [t.detach() for t in model.state_dict().values()]


def stream_bytes(model):
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


def byte_view(t):
    return t.reshape(-1).view(torch.uint8)


def init(p):
    role = os.environ["RELAX_ROLE"]
    if p.get("api", "cuda") != "cuda":
        raise rw.WorkerError("unsupported", "the torch worker runs on CUDA (torch_npu is not wired in)")
    loss = p.get("loss") or {}
    if role == "trainer" and loss.get("value_coef", 0) > 0:
        raise rw.WorkerError("unsupported", "the torch worker does GRPO only (PPO needs a value head)")
    if role == "trainer" and not p.get("backup", True):
        raise rw.WorkerError("unsupported", "the torch trainer relies on the hook's CPU backup (memory.backup = true)")
    device = torch.device("cuda", p["device"])
    torch.cuda.set_device(device)
    shape = p["shape"]
    vocab, context, hidden = shape["vocab"], shape["context"], shape["hidden"]
    hidden = max(HEADS, hidden - hidden % HEADS)
    backup = role == "trainer"
    torch.manual_seed(p.get("seed", 0))
    state.update(role=role, device=device, loss=loss, context=context, transfer=None, pads=[],
                 compute=p.get("compute"), dp=(0, 1))
    group = p.get("trainer_group") if role == "trainer" else None
    if group:
        join_trainer_group(group, device)
    with tms.region("weights", enable_cpu_backup=backup):
        model = Policy(vocab, context, hidden).to(device)
    state["model"] = model
    if role == "trainer":
        with tms.region("ref", enable_cpu_backup=True):
            ref = Policy(vocab, context, hidden).to(device)
        replicate_from_rank0(model)
        ref.load_state_dict(model.state_dict())
        ref.requires_grad_(False)
        state["ref"] = ref
        with tms.region("grads", enable_cpu_backup=True):
            for w in model.parameters():
                w.grad = torch.zeros_like(w)
        adam = p.get("adam") or {}
        opt = torch.optim.AdamW(model.parameters(), lr=adam.get("lr", 1e-3),
                                betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.999)),
                                eps=adam.get("eps", 1e-8), weight_decay=0.0, foreach=False)
        with tms.region("optimizer", enable_cpu_backup=True):
            for w in model.parameters():
                opt.state[w] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w),
                                "exp_avg_sq": torch.zeros_like(w)}
        state.update(opt=opt, max_grad_norm=adam.get("max_grad_norm", 1.0))
    else:
        batch = max(1, p.get("max_batch", 1))
        with tms.region("kv_cache"):
            state["kv"] = torch.zeros((LAYERS, 2, batch, HEADS, context, hidden // HEADS), device=device)
        capture_sampling_head(batch, vocab)
    for tag, sizes in p.get("memory", []):
        for size in sizes:
            with tms.region(tag, enable_cpu_backup=backup):
                t = torch.empty(size, dtype=torch.uint8, device=device)
            head = min(size, 4096)
            t[:head].copy_(torch.frombuffer(bytearray(os.urandom(head)), dtype=torch.uint8))
            state["pads"].append(t)
    if role == "trainer":
        snapshot()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"params": sum(w.numel() for w in model.parameters()), "hook_mode": tms.hook_mode(),
            "torch": torch.__version__}


def join_trainer_group(g, device):
    """The trainers' data-parallel process group (docs/worker-protocol.md, `trainer_group`)."""
    if g.get("backend") != "nccl":
        raise rw.WorkerError("unsupported", f"trainer_group backend {g.get('backend')!r}: the torch worker runs NCCL")
    # device_id: the communicator is made now, on this rank's device, not at the first collective.
    dist.init_process_group("nccl", init_method=g["init_method"], rank=g["rank"], world_size=g["world"],
                            timeout=timedelta(seconds=120), device_id=device)
    state["dp"] = (g["rank"], g["world"])
    # Leaving the group at exit, suspended or not, gives NCCL's memory back without its warning.
    atexit.register(dist.destroy_process_group)


@torch.no_grad()
def replicate_from_rank0(model):
    """Rank 0's weights on every rank, as DDP broadcasts them when it wraps a model."""
    if state["dp"][1] > 1:
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def all_reduce_sum(tensors):
    """Sums `tensors` over the trainers in place, in one collective (one bucket, as DDP's)."""
    if state["dp"][1] == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def token_scale():
    """Modelled tokens per task token for the request being served: its own `token_scale`
    (compute.token_scale_final grows it over the run, by the weight version that generated the
    samples) or, from a runner that sends none, init's."""
    return state.get("request_token_scale") or state["compute"]["token_scale"]


def serve_scale(p):
    """Takes the request's own `token_scale` (absent: init's) for its modelled compute."""
    state["request_token_scale"] = p.get("token_scale")


def modelled_s(tokens, passes, mfu, devices=1.0):
    """Seconds `tokens` task tokens through `passes` forward-pass equivalents take on the modelled
    device at `mfu`, shared by `devices` replicas (compute.model, docs/async.md)."""
    m = state["compute"]
    flops = tokens * token_scale() * passes * m["forward_flops_per_token"]
    return flops / (m["tflops"] * 1e12 * mfu * max(1.0, devices))


def stage_s(name, tokens, devices=1.0):
    """Seconds `tokens` task tokens through stage `name` of the compute model (its passes at its
    MFU, relax_compute_model.json) take, shared by `devices` replicas."""
    stage = FIGURES["stages"][name]
    return modelled_s(tokens, stage["passes"], state["compute"][stage["mfu"]], devices)


def decode_s(seqs):
    """Seconds the decode steps of `seqs` take on the modelled device, each sequence given as
    (context tokens before its first new token, new tokens). Each task step stands for
    `token_scale` steps of the modelled job: the longer of their FLOPs at `rollout_mfu` and their
    reads (the weights, and every active sequence's KV cache) at `hbm_gbps`, plus the fixed
    `decode_step_ms` each of them pays, as the built-in workers charge them
    (ComputeModel::decode_step_seconds, docs/async.md)."""
    m = state["compute"]
    fixed = token_scale() * (m.get("decode_step_ms") or 0.0) / 1e3
    total = 0.0
    for t in range(max((g for _, g in seqs), default=0)):
        live = [c + t for c, g in seqs if t < g]
        compute = stage_s("decode", len(live))
        gbps = m.get("hbm_gbps") or 0.0
        if gbps > 0:
            s = token_scale()
            kv_tokens = s * (sum(live) + FIGURES["decode_kv_midpoint"] * len(live))
            reads = s * (m.get("weight_bytes", 0.0) + m.get("kv_bytes_per_token", 0.0) * kv_tokens)
            compute = max(compute, reads / (gbps * 1e9))
        total += compute + fixed
    return total


def pace(t0, seconds):
    """Modelled compute: a request that began at `t0` lasts at least `seconds`, as the built-in
    workers' do. This small model on the simulator's CPU says nothing about a device's time, and
    what the async layout overlaps is that time."""
    rest = seconds - (time.monotonic() - t0)
    if rest > 0:
        time.sleep(rest)


def pace_trainer(t0, tokens, stage, replicas=None):
    """The trainer's `stage`, the batch shared by the trainer replicas (`replicas`: a train
    request's own count, elastic mode's reverse lend adding lent trainers; None: init's).
    Returns the modelled seconds it was paced at (None without modelled compute)."""
    m = state["compute"]
    if not m:
        return None
    seconds = stage_s(stage, tokens, replicas or m["trainers"])
    pace(t0, seconds)
    return seconds


def capture_sampling_head(batch, vocab):
    """The rollout's sampling head (temperature and log-softmax over the vocabulary) as a CUDA
    graph whose private pool is in the "cuda_graph" tag, as engines capture their decode step:
    every decode step replays it, so each wake_up proves a paused and resumed graph still runs.
    The tag has no backup, so the graph's inputs are rewritten before every replay."""
    with tms.region("cuda_graph"):
        head_in = torch.zeros((batch, vocab), device=state["device"])
        inv_temp = torch.ones((), device=state["device"])
    # Warm up off the capture, on a side stream, as torch.cuda.graphs recommends.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.log_softmax(head_in * inv_temp, dim=-1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag="cuda_graph"):
        head_out = torch.log_softmax(head_in * inv_temp, dim=-1)
    state.update(head_graph=graph, head_in=head_in, head_out=head_out, inv_temp=inv_temp)


def sampling_logp(logits):
    """Log-probabilities of the next token for each row of `logits`, through the captured head."""
    rows = logits.shape[0]
    state["head_in"][:rows].copy_(logits.float())
    state["head_graph"].replay()
    return state["head_out"][:rows]


def snapshot():
    """The weights stream in host memory, for packing while the trainer's tags are paused."""
    snap = state.get("snapshot")
    if snap is None:
        snap = state["snapshot"] = torch.empty(stream_bytes(state["model"]), dtype=torch.uint8, pin_memory=True)
    at = 0
    for t in weight_tensors(state["model"]):
        b = byte_view(t)
        snap[at:at + b.numel()].copy_(b)
        at += b.numel()


def checksum(p):
    h = hashlib.sha256()
    for t in weight_tensors(state["model"]):
        h.update(byte_view(t).cpu().numpy().tobytes())
    return {"weights": h.hexdigest()[:16], "bytes": stream_bytes(state["model"])}


def generation_batches(p, capacity):
    """The request's sequences as batches the KV cache can decode together: (slot, prompt index,
    context, prefix length) rows of equal context length, at most `capacity` of them. Fresh
    sequences are batched per prompt (its `n` samples); continued ones, which the runner sends one
    per prompt, by the length of prompt + prefix, so that a resumed segment is a few batches and
    not one per sequence."""
    prompts, n = p["prompts"], p["n"]
    responses = p.get("responses") or []
    if responses and len(responses) != len(prompts) * n:
        raise rw.WorkerError("bad_request", f"responses has {len(responses)} entries for {len(prompts) * n} sequences")
    groups = {}
    for i, prompt in enumerate(prompts):
        for s in range(n):
            slot = i * n + s
            prefix = list(responses[slot]) if responses else []
            key = len(prompt) + len(prefix) if responses else i
            groups.setdefault(key, []).append((slot, i, list(prompt) + prefix, len(prefix)))
    for rows in groups.values():
        for at in range(0, len(rows), capacity):
            yield rows[at:at + capacity]


@torch.no_grad()
def generate(p):
    """Samples `n` responses per prompt. Partial rollouts (async mode): a sequence given a
    `responses` prefix continues after it, the prompt and prefix prefilled again under the weights
    held now (the cache of the interrupted segment was computed under older ones); at most
    `segment_tokens` new tokens per sequence; the reply carries the new tokens only, and
    `finished` once EOS, `max_new_tokens` in all or the context's end is reached. With modelled
    compute, `segment_s` ends the segment once that much modelled decoding is spent, mid-token if
    need be: the tokens past the cut are dropped and each unfinished sample says its `progress`
    (paced_decode). It ignores `sequence_seeds` (docs/worker-protocol.md allows it) and samples
    from `seed`."""
    serve_scale(p)
    t0 = time.monotonic()
    model, kv, dev = state["model"], state["kv"], state["device"]
    gen = torch.Generator(device=dev)
    gen.manual_seed(p.get("seed", 0) & (2**63 - 1))
    temperature = p.get("temperature", 1.0)
    if not temperature > 0:
        raise rw.WorkerError("bad_request", f"temperature={temperature}: the torch worker samples, it needs a temperature above 0")
    eos, n, max_new = p.get("eos"), p["n"], p["max_new_tokens"]
    capacity = kv.shape[2]
    if n > capacity:
        raise rw.WorkerError("bad_request", f"n={n} samples exceed the KV cache's {capacity} sequences")
    segment = p.get("segment_tokens")
    if segment is not None and segment < 1:
        raise rw.WorkerError("bad_request", f"segment_tokens={segment}: a segment needs at least one token")
    state["inv_temp"].fill_(1.0 / temperature)
    samples = [None] * (len(p["prompts"]) * n)
    for rows in generation_batches(p, capacity):
        width = len(rows[0][2])
        # Per row, the new tokens allowed: what is left of max_new_tokens, of the context, and of
        # the segment. Rows of a batch share the context but not always the prefix length.
        limits = [max(0, min(max_new - had, state["context"] - width)) for _, _, _, had in rows]
        steps = max(limits) if segment is None else min(max(limits), segment)
        tokens = torch.tensor([row[2] for row in rows], device=dev)
        logits = model(tokens, kv, 0)[:, -1]
        out, lps = [], []
        for t in range(steps):
            logp = sampling_logp(logits)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            out.append(tok)
            lps.append(logp.gather(1, tok))
            if t + 1 < steps:
                logits = model(tok, kv, width + t)[:, -1]
        toks = torch.cat(out, 1).tolist() if out else [[] for _ in rows]
        lps = torch.cat(lps, 1).tolist() if lps else [[] for _ in rows]
        for r, (slot, i, _, _) in enumerate(rows):
            cut = min(steps, limits[r])
            new = toks[r][:cut]
            ended = eos in new
            end = new.index(eos) + 1 if ended else cut
            finished = ended or cut == limits[r]
            samples[slot] = {"prompt_index": i, "response": new[:end], "logprobs": lps[r][:end], "finished": finished}
    torch.cuda.empty_cache()
    m = state["compute"]
    prefixes = p.get("responses") or []
    # The modelled schedule runs with or without a compute model, as the built-in rollout's: it is
    # what the reply's `decode` reports. Without one a task token is a free step and no budget binds.
    seqs = [(len(p["prompts"][x["prompt_index"]]) + (len(prefixes[k]) if prefixes else 0), len(x["response"]))
            for k, x in enumerate(samples)]
    spent, kept, carried, again, stats = paced_decode(seqs, (p.get("progress") or []) if m else [],
                                                      p.get("segment_s") if m else None, slots=capacity)
    for x, k, steps in zip(samples, kept, carried):
        if k < len(x["response"]):
            x.update(response=x["response"][:k], logprobs=x["logprobs"][:k], finished=False)
        if not x["finished"] and steps > 0:
            x["progress"] = steps
    if m:
        # Charged as an engine that keeps its cache between segments would be: the prefill only
        # when the prefixes are not cached (this worker re-prefills them every time regardless),
        # compute-bound like the trainer's passes, and a preempted sequence's again on its
        # readmission; decoding step by step.
        if not prefixes:
            prefill = n * sum(len(x) for x in p["prompts"])
        else:
            # A continued sequence's prefix is cached when `cached` (one flag per sequence, given
            # when they differ) or else prefix_cached says so; a new one (no response yet, no
            # steps towards its first token) is always prefilled.
            steps = p.get("progress") or [0.0] * len(prefixes)
            held = p.get("cached") or [bool(p.get("prefix_cached"))] * len(prefixes)
            prefill = sum(len(x) + len(r) for x, r, d, c in zip(p["prompts"], prefixes, steps, held)
                          if not (c and (r or d > 0)))
        pace(t0, stage_s("prefill", prefill + again) + spent)
    return {"samples": samples, "decode": stats}


class Admission:
    """Which of a request's sequences the engine decodes at each step when its KV cache is bounded
    (docs/async.md, "KV capacity"), as relax-colocate's built-in rollout schedules them
    (src/run/admission.rs) and vLLM v1 does: the running sequences' growth first, the most recently
    admitted preempted (its KV freed, back to the front of the queue, prefilled again when
    readmitted) while it does not fit; then the queue's head admitted while its tokens and the
    token it decodes fit, an empty engine taking it whatever its size. Without a capacity every
    live sequence runs. Either way it tallies the reply's `decode` figures."""

    def __init__(self, sequences, slots, capacity, scale):
        # Task tokens of KV; a capacity that bounds nothing is none, but still reported as one.
        self.capacity = capacity if capacity is not None and math.isfinite(capacity) and capacity > 0 else None
        self.scale = scale
        self.running, self.waiting = [], list(range(sequences))
        self.preempted = [False] * sequences
        self.stats = {"steps": 0.0, "slot_steps": 0.0, "slots": slots, "preemptions": 0, "recomputed_tokens": 0.0,
                      "kv_queued_s": 0.0}
        if capacity is not None:
            self.stats["kv_peak_share"] = 0.0

    def schedule(self, live, context):
        """The sequences that decode this step (a flag each), given which are `live` and each
        one's `context` (prompt and response, task tokens), and the task tokens prefilled again
        for readmitted ones."""
        # A sequence that stopped frees its KV; one waiting that stopped leaves the queue.
        self.running = [i for i in self.running if live[i]]
        self.waiting = [i for i in self.waiting if live[i]]

        def used():
            return sum(float(context[i]) for i in self.running)
        recomputed = 0
        cap = self.capacity
        if cap is None:
            self.running += self.waiting
            self.waiting = []
        else:
            while len(self.running) > 1 and used() + len(self.running) > cap:
                last = self.running.pop()
                self.preempted[last] = True
                self.stats["preemptions"] += 1
                self.waiting.insert(0, last)
            while self.waiting:
                nxt = self.waiting[0]
                need = used() + len(self.running) + context[nxt] + 1.0
                if self.running and need > cap:
                    break
                self.waiting.pop(0)
                if self.preempted[nxt]:
                    recomputed += context[nxt]
                self.running.append(nxt)
            held = (used() + len(self.running)) / cap
            self.stats["kv_peak_share"] = max(self.stats.get("kv_peak_share", 0.0), held)
        self.stats["recomputed_tokens"] += recomputed * self.scale
        now = [False] * len(live)
        for i in self.running:
            now[i] = True
        return now, recomputed

    def ran(self, steps, seconds, active):
        """The step ran `steps` modelled decode steps over `seconds` with `active` sequences."""
        self.stats["steps"] += steps
        self.stats["slot_steps"] += steps * active
        self.stats["kv_queued_s"] += seconds * len(self.waiting)


def paced_decode(seqs, progress, budget, slots=None):
    """The modelled decode of a request, as the built-in rollout runs it (relax-colocate's
    src/run/pacer.rs and admission.rs): `seqs` as decode_s takes them (context before the first
    new token, new tokens generated), `progress` the modelled steps each already did towards its
    next token (empty: none), `slots` the engine's batch slots (None: one per sequence). The
    sequences that fit the KV capacity (init's compute.kv_capacity_tokens; none: all) decode
    together, every one advancing by the same steps, and a token completes when its sequence's
    steps reach token_scale(); with a `budget` (modelled seconds, async.segment_s) the decode ends
    once it is spent. Without a compute model a task token is one free step. Returns the seconds
    charged, the tokens each sequence completed, the steps each carries towards its next, the task
    tokens prefilled again for preempted sequences, and the `decode` figures of the reply."""
    m = state["compute"]
    scale, tolerance = (token_scale() if m else 1.0), FIGURES["token_tolerance"]
    done = [float(x) for x in progress] if progress else [0.0] * len(seqs)
    if len(done) != len(seqs) or any(not (x >= 0 and math.isfinite(x)) for x in done):
        raise rw.WorkerError("bad_request", f"progress {progress} is not one count >= 0 per sequence")
    capacity = (m or {}).get("kv_capacity_tokens")
    admission = Admission(len(seqs), len(seqs) if slots is None else slots,
                          None if capacity is None else capacity / scale, scale)
    kept, spent, again = [0] * len(seqs), 0.0, 0
    while True:
        contexts = [c + kept[i] for i, (c, _) in enumerate(seqs)]
        now, recomputed = admission.schedule([kept[i] < g for i, (_, g) in enumerate(seqs)], contexts)
        again += recomputed
        live = [i for i, run in enumerate(now) if run]
        if not live:
            return spent, kept, done, again, admission.stats
        per_step = (decode_s([(contexts[i], 1) for i in live]) if m else 0.0) / scale
        need = min(max(scale - done[i], 0.0) for i in live)
        if budget and per_step > 0 and max(budget - spent, 0.0) / per_step < need - tolerance * scale:
            steps = max(budget - spent, 0.0) / per_step
            for i in live:
                done[i] += steps
            admission.ran(steps, (spent + steps * per_step) - spent, len(live))
            return spent + steps * per_step, kept, done, again, admission.stats
        before, spent = spent, spent + need * per_step
        admission.ran(need, spent - before, len(live))
        for i in live:
            done[i] += need
            if scale - done[i] <= tolerance * scale:
                done[i], kept[i] = 0.0, kept[i] + 1


def batch_of(samples):
    """Right-padded prompt+response tokens and, per response token, the (row, position) whose
    logits predict it."""
    dev = state["device"]
    seqs = [list(s["prompt"]) + list(s["response"]) for s in samples]
    width = max(len(x) for x in seqs)
    tokens = torch.tensor([x + [0] * (width - len(x)) for x in seqs], device=dev)
    rows, cols, targets = [], [], []
    for r, s in enumerate(samples):
        start = len(s["prompt"])
        for t, tok in enumerate(s["response"]):
            rows.append(r)
            cols.append(start + t - 1)
            targets.append(tok)
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return tokens, index, torch.tensor(targets, device=dev)


def token_logprobs(model, samples):
    tokens, index, targets = batch_of(samples)
    temperature = state["loss"].get("temperature", 1.0)
    logp = torch.log_softmax(model(tokens)[index].float() / temperature, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], logp


def split(flat, samples):
    out, at = [], 0
    for s in samples:
        out.append(flat[at:at + len(s["response"])])
        at += len(s["response"])
    return out


@torch.no_grad()
def log_probs(p):
    serve_scale(p)
    t0 = time.monotonic()
    model = state["ref"] if p.get("model") == "ref" else state["model"]
    samples = [s for s in p["samples"] if s["response"]]
    lp, full = token_logprobs(model, samples) if samples else (torch.zeros(0), torch.zeros(0, 1))
    ent = -(full.exp() * full).sum(-1)
    lp, ent = lp.tolist(), ent.tolist()
    lps, ents = split(lp, samples), split(ent, samples)
    it = iter(zip(lps, ents))
    out = [next(it) if s["response"] else ([], []) for s in p["samples"]]
    torch.cuda.empty_cache()
    pace_trainer(t0, sum(len(s["prompt"]) + len(s["response"]) for s in p["samples"]), "log_probs")
    return {"logprobs": [a for a, _ in out], "entropy": [b for _, b in out]}


def kl_term(logp, ref, kind):
    x = logp - ref
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    return (torch.exp(-x) - 1 + x).clamp(max=K3_CLAMP)


def aggregate(per_token, lengths, how, tokens, seqs):
    """This rank's share of the minibatch's aggregate: its sum over the `tokens` tokens or `seqs`
    sequences of the whole minibatch, so that the ranks' shares add up to the aggregate."""
    if how == "token-mean":
        return per_token.sum() / max(1, tokens)
    parts = per_token.split(lengths)
    if how == "seq-mean-token-sum":
        return torch.stack([s.sum() for s in parts]).sum() / seqs
    return torch.stack([s.mean() for s in parts]).sum() / seqs


def minibatch_loss(samples, tokens, seqs):
    """The loss and statistics of `samples`, this rank's share of a minibatch of `tokens` response
    tokens in `seqs` sequences: summed over the ranks they are the minibatch's."""
    loss_cfg = state["loss"]
    clip = loss_cfg["clip"]
    dev = state["device"]
    logp, full = token_logprobs(state["model"], samples)
    flat = lambda key: torch.tensor([v for s in samples for v in s[key]], device=dev, dtype=torch.float32)  # noqa: E731
    adv, old, ref = flat("advantages"), flat("old_logprobs"), flat("ref_logprobs")
    # The off-policy correction's per-token weights (none sent: 1), a constant on the
    # policy-gradient term only.
    isw = torch.tensor([w for s in samples for w in (s.get("is_weights") or [1.0] * len(s["response"]))],
                       device=dev, dtype=torch.float32)
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip["eps_low"], 1 + clip["eps_high"])
    pg = torch.maximum(unclipped, clipped)
    dual = clip.get("dual")
    dual_hit = torch.zeros_like(pg, dtype=torch.bool)
    if dual:
        dual_hit = (adv < 0) & (pg > -dual * adv)
        pg = torch.where(dual_hit, -dual * adv, pg)
    pg = pg * isw
    kl = kl_term(logp, ref, loss_cfg.get("kl_kind", "k3"))
    entropy = -(full.exp() * full).sum(-1)
    lengths = [len(s["response"]) for s in samples]
    how = loss_cfg.get("aggregation", "token-mean")
    loss = aggregate(pg + loss_cfg.get("kl_coef", 0.0) * kl - loss_cfg.get("entropy_coef", 0.0) * entropy,
                     lengths, how, tokens, seqs)
    share = lambda x: x.float().sum() / tokens  # noqa: E731  (this rank's part of the token mean)
    stats = {"pg_loss": aggregate(pg, lengths, how, tokens, seqs), "kl": share(kl), "entropy": share(entropy),
             "clip_frac": share(clipped > unclipped), "dual_clip_frac": share(dual_hit),
             "ppo_kl": share(old - logp), "tis_weight_mean": share(isw)}
    return loss, stats


STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "dual_clip_frac", "ppo_kl", "tis_weight_mean")


def check_samples(samples):
    """A train request's per-token lists, one entry per response token (is_weights may be left
    out), refused naming the field as the built-in trainer does."""
    for i, s in enumerate(samples):
        n = len(s["response"])
        for key in ("advantages", "old_logprobs", "ref_logprobs", "is_weights"):
            v = s.get(key)
            if key == "is_weights" and not v:
                continue
            if v is None or len(v) != n:
                extra = " (or none, for weights of 1)" if key == "is_weights" else ""
                raise rw.WorkerError("bad_request", f"train sample {i}: {key} has {len(v or [])} entries for a "
                                     f"response of {n} tokens: one per token{extra}")
        bad = [w for w in s.get("is_weights") or [] if not (w >= 0.0 and w < float("inf"))]
        if bad:
            raise rw.WorkerError("bad_request", f"train sample {i}: is_weights holds {bad[0]}: each weight must "
                                 "be a finite number >= 0")


def minibatch_step(model, opt, batch):
    """One optimizer step on `batch`: this rank's share of it forward and backward, the gradients
    summed over the ranks, clipped, AdamW. Every rank makes the same collectives in the same order,
    an empty share included. Returns the minibatch's statistics (the ranks' shares summed)."""
    rank, world = state["dp"]
    mine = batch[rank::world]
    tokens, seqs = sum(len(s["response"]) for s in batch), len(batch)
    opt.zero_grad(set_to_none=False)  # the grads stay in their tagged pool
    stats = torch.zeros(len(STATS), device=state["device"])
    if mine:
        loss, parts = minibatch_loss(mine, tokens, seqs)
        loss.backward()
        parts["loss"] = loss
        stats = torch.stack([parts[k].detach().float() for k in STATS])
    params = list(model.parameters())
    all_reduce_sum([w.grad for w in params] + [stats])
    norm = torch.nn.utils.clip_grad_norm_(params, state["max_grad_norm"], foreach=False)
    opt.step()
    out = dict(zip(STATS, stats.tolist()))
    out["grad_norm"] = float(norm)
    return out


def train(p):
    serve_scale(p)
    t0 = time.monotonic()
    model, opt = state["model"], state["opt"]
    check_samples(p["samples"])
    samples = [s for s in p["samples"] if s["response"]]
    if not samples:
        return {"loss": 0.0, "tokens": 0}
    chunks = max(1, min(p.get("minibatches", 1), len(samples)))
    size = -(-len(samples) // chunks)
    totals, count = {}, 0
    for _ in range(max(1, p.get("epochs", 1))):
        for at in range(0, len(samples), size):
            for k, v in minibatch_step(model, opt, samples[at:at + size]).items():
                totals[k] = totals.get(k, 0.0) + v
            count += 1
    snapshot()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    epochs = max(1, p.get("epochs", 1))
    replicas = p.get("replicas")
    paced = pace_trainer(t0, epochs * sum(len(s["prompt"]) + len(s["response"]) for s in samples), "train", replicas)
    metrics = {k: v / count for k, v in totals.items()}
    metrics["tokens"] = sum(len(s["response"]) for s in samples)
    if paced is not None:
        metrics.update(replicas=replicas or state["compute"]["trainers"], modelled_s=paced)
    return metrics


def trainer_state():
    """Everything `train` reads, by name: the actor, the reference, the gradient buffers, AdamW's
    moments and step counts, the profile's memory. Tensors in place, so a lent trainer loads into
    the memory its regions made (a new tensor would be outside every tag, and not sleep)."""
    model, opt = state["model"], state["opt"]
    out = {f"model.{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    out.update({f"ref.{k}": v for k, v in state["ref"].state_dict(keep_vars=True).items()})
    for i, w in enumerate(model.parameters()):
        out[f"grad.{i}"] = w.grad
        for k, v in opt.state[w].items():
            out[f"opt.{i}.{k}"] = v
    out.update({f"pad.{i}": t for i, t in enumerate(state["pads"])})
    return out


def export_state(p):
    """elastic.lend_rollout: the trainer's whole state to the file `path` (docs/worker-protocol.md),
    as a checkpoint through the host."""
    if state["dp"][1] > 1:
        raise rw.WorkerError(
            "unsupported",
            f"this trainer is one of {state['dp'][1]} data-parallel ranks whose update is all-reduced; a lent "
            "trainer outside their group would sum the batch in another order and could not hold their weights "
            "byte for byte: lend rollout devices with one trainer device, or elastic.lend_rollout = false")
    torch.cuda.synchronize()
    torch.save({k: v.detach().cpu() for k, v in trainer_state().items()}, p["path"])
    return {}


def import_state(p):
    """A lent trainer takes the state `export_state` wrote, into its own tensors."""
    saved = torch.load(p["path"], map_location="cpu", weights_only=True)
    mine = trainer_state()
    if saved.keys() != mine.keys():
        missing, extra = sorted(mine.keys() - saved.keys()), sorted(saved.keys() - mine.keys())
        raise rw.WorkerError("internal", f"state file {p['path']}: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for k, t in mine.items():
            src = saved[k]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise rw.WorkerError("internal", f"state file {p['path']}: {k} is {tuple(src.shape)} {src.dtype}, "
                                     f"this trainer's {tuple(t.shape)} {t.dtype}")
            t.copy_(src)
    snapshot()
    torch.cuda.synchronize()
    return {}


def values(p):
    raise rw.WorkerError("unsupported", "the torch worker does GRPO only (no value head)")


def update_begin(p):
    total = stream_bytes(state["model"])
    bucket = p["bucket_bytes"]
    f = open(p["shm"], "r+b")
    # Outside any region: the staging buffer must stay while the tags around it are paused.
    staging = torch.empty(min(bucket, total), dtype=torch.uint8, device=state["device"])
    state["transfer"] = (f, mmap.mmap(f.fileno(), 0), bucket, staging)
    return {"buckets": bucket_count(total, bucket), "bytes": total}


def bucket_count(total, bucket):
    """How many buckets of `bucket` bytes carry `total` bytes of weights (the last may be short)."""
    return -(-total // bucket)


def bucket_pieces(i, bucket):
    """(weight's bytes, slice of them, offset in the bucket) for every weight bucket i (of
    `bucket` bytes) covers, on the rollout; the trainer's one piece is its snapshot."""
    lo, hi = i * bucket, (i + 1) * bucket
    if state["role"] == "trainer":
        total = state["snapshot"].numel()
        yield state["snapshot"], slice(lo, min(hi, total)), 0
        return
    yield from stream_pieces(lo, hi)


def stream_pieces(lo, hi):
    """(weight's bytes, slice of them, offset from `lo`) for every weight of the model that bytes
    [lo, hi) of the weights stream cover."""
    weights = weight_tensors(state["model"])
    for k, part, off in layout_pieces([t.numel() * t.element_size() for t in weights], lo, hi):
        yield byte_view(weights[k]), part, off


def layout_pieces(sizes, lo, hi):
    """(entry, slice of its bytes, offset from `lo`) for every entry of `sizes` bytes, laid end to
    end, that bytes [lo, hi) cover: the weights stream's layout, as relax-colocate's bucket_pieces."""
    at = 0
    for k, n in enumerate(sizes):
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            yield k, slice(a - at, b - at), a - lo
        at += n


def pack(p):
    f, m, bucket, staging = state["transfer"]
    n = 0
    for src, part, off in bucket_pieces(p["bucket"], bucket):
        length = part.stop - part.start
        staging[off:off + length].copy_(src[part])
        n = off + length
    m[0:n] = staging[:n].cpu().numpy().tobytes()
    return {"bytes": n}


@torch.no_grad()
def unpack(p):
    f, m, bucket, staging = state["transfer"]
    pieces = list(bucket_pieces(p["bucket"], bucket))
    n = pieces[-1][2] + (pieces[-1][1].stop - pieces[-1][1].start) if pieces else 0
    staging[:n].copy_(torch.frombuffer(bytearray(m[0:n]), dtype=torch.uint8))
    for dst, part, off in pieces:
        dst[part].copy_(staging[off:off + part.stop - part.start])
    return {"bytes": n}


def update_end(p):
    f, m, _, staging = state["transfer"]
    m.close()
    f.close()
    state["transfer"] = None
    del staging
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {}


# The IPC weight transport (docs/worker-protocol.md), as slime's colocated update_weights_from_tensor
# moves weights: the trainer exports a device buffer of one bucket by its CUDA IPC handle, the engine
# on its device opens it, and each bucket goes from the trainer's snapshot through the buffer into
# the engine's weights, no host file between them. The buffer comes from cudaMalloc itself, outside
# every region and outside torch's caching allocator: a cached block may sit inside a larger
# segment, and a handle names the whole allocation (the importer gets its start), so only an
# allocation of its own is named exactly by its handle. CUDA has no importer whitelist:
# `importers` is for Ascend's, and the torch worker runs on CUDA only.
CUDA_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t


class DeviceBytes:
    """`n` bytes at device address `ptr`, for torch.as_tensor (the CUDA array interface)."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def cudart():
    """The CUDA runtime torch itself loaded: dlopen by its soname returns the loaded object."""
    lib = state.get("cudart")
    if lib is None:
        lib = ctypes.CDLL("libcudart.so.%s" % torch.version.cuda.split(".")[0])
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        state["cudart"] = lib
    return lib


def cuda_call(what, rc):
    if rc != 0:
        raise rw.WorkerError("oom" if rc == 2 else "device", "%s returned CUDA error %d" % (what, rc))


def open_ipc(method, exported):
    ipc = state.get("ipc")
    if not ipc or ipc["exported"] != exported:
        first = "ipc_export" if exported else "ipc_import"
        raise rw.WorkerError("bad_request", "%s before %s" % (method, first))
    return ipc


def ipc_pid(p):
    return {"pid": os.getpid()}


def ipc_export(p):
    if state.get("ipc"):
        raise rw.WorkerError("bad_request", "ipc_export while the last export is still open (ipc_close first)")
    bucket = p.get("bucket_bytes", 0)
    if bucket <= 0:
        raise rw.WorkerError("bad_request", "bucket_bytes must be positive")
    total = stream_bytes(state["model"])
    n = max(1, min(bucket, total))
    lib, ptr, handle = cudart(), ctypes.c_void_p(), IpcHandle()
    cuda_call("cudaMalloc(%d)" % n, lib.cudaMalloc(ctypes.byref(ptr), n))
    rc = lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr)
    if rc != 0:
        lib.cudaFree(ptr)
        cuda_call("cudaIpcGetMemHandle", rc)
    buf = torch.as_tensor(DeviceBytes(ptr.value, n), device=state["device"])
    state["ipc"] = {"ptr": ptr.value, "bucket": bucket, "buf": buf, "exported": True}
    return {"handle": bytes(handle).hex(), "buffer_bytes": n, "buckets": bucket_count(total, bucket), "bytes": total}


def ipc_import(p):
    if state.get("ipc"):
        raise rw.WorkerError("bad_request", "ipc_import while the last import is still open (ipc_close first)")
    raw = bytes.fromhex(p.get("handle", ""))
    n, bucket = p.get("buffer_bytes", 0), p.get("bucket_bytes", 0)
    if len(raw) != ctypes.sizeof(IpcHandle) or n <= 0 or bucket <= 0:
        raise rw.WorkerError("bad_request", "ipc_import needs the 64-byte handle of ipc_export, buffer_bytes and "
                             "bucket_bytes")
    ptr = ctypes.c_void_p()
    cuda_call("cudaIpcOpenMemHandle", cudart().cudaIpcOpenMemHandle(
        ctypes.byref(ptr), IpcHandle.from_buffer_copy(raw), CUDA_IPC_LAZY_ENABLE_PEER_ACCESS))
    buf = torch.as_tensor(DeviceBytes(ptr.value, n), device=state["device"])
    state["ipc"] = {"ptr": ptr.value, "bucket": bucket, "buf": buf, "exported": False}
    return {}


@torch.no_grad()
def ipc_pack(p):
    ipc = open_ipc("ipc_pack", True)
    for src, part, off in bucket_pieces(p["bucket"], ipc["bucket"]):
        ipc["buf"][off:off + part.stop - part.start].copy_(src[part])
    torch.cuda.synchronize()
    return {}


@torch.no_grad()
def ipc_copy(p):
    ipc = open_ipc("ipc_copy", False)
    for dst, part, off in bucket_pieces(p["bucket"], ipc["bucket"]):
        dst[part].copy_(ipc["buf"][off:off + part.stop - part.start])
    torch.cuda.synchronize()
    return {}


def ipc_close(p):
    """The engine closes its import; the trainer (after it) frees the exported buffer."""
    ipc = state.pop("ipc", None)
    if ipc:
        torch.cuda.synchronize()
        del ipc["buf"]
        lib = cudart()
        if ipc["exported"]:
            cuda_call("cudaFree", lib.cudaFree(ipc["ptr"]))
        else:
            cuda_call("cudaIpcCloseMemHandle", lib.cudaIpcCloseMemHandle(ipc["ptr"]))
    return {}


# The broadcast weight transport (docs/async.md, docs/worker-protocol.md): the first trainer is
# rank 0 of a weight-sync group, the rollout engines ranks 1..N, and each update is broadcast from
# rank 0 in buckets over NCCL, as slime's and SGLang's `update_weights_from_distributed` move them.
# The group is a ProcessGroupNCCL made on a TCP store of its own, not torch.distributed's default
# group: the trainers may already have that one (`trainer_group`), and a process has one default.
SYNC_TIMEOUT = timedelta(seconds=120)


def sync_library(p):
    if p.get("library") != "nccl":
        raise rw.WorkerError("unsupported", f"library {p.get('library')!r}: the torch worker broadcasts over NCCL")


def rendezvous_host():
    """This host's address as the group's other members reach it: its name's, or the loopback
    when the name does not resolve (every member is then on this host)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def group_id(p):
    """Rank 0 serves the group's TCP store on a port the system gives it (no port is picked free
    and then bound, the race verl 5043 has); the id is its address, tcp://HOST:PORT."""
    sync_library(p)
    if state.get("sync") or state.get("sync_store"):
        raise rw.WorkerError("bad_request", "group_id: this worker already has a weight-sync group")
    host = rendezvous_host()
    store = dist.TCPStore(host, 0, is_master=True, timeout=SYNC_TIMEOUT, wait_for_workers=False)
    state["sync_store"] = store
    return {"id": f"tcp://{host}:{store.port}"}


def group_init(p):
    """Joins the weight-sync group. The communicator is made here, with every member present (the
    runner asks them all before reading an answer), not lazily at the first update."""
    t0 = time.monotonic()
    sync_library(p)
    if state.get("sync"):
        raise rw.WorkerError("bad_request", "group_init: this worker is already in a weight-sync group")
    rank, world, addr = p["rank"], p["world"], p["id"]
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not host or not port.isdigit():
        raise rw.WorkerError("bad_request", f"group_init: id {addr!r} is not the tcp://HOST:PORT of a torch "
                             "worker's group_id (the group's rank 0 must be a torch worker too)")
    store = state.pop("sync_store", None)
    if rank == 0 and store is None:
        raise rw.WorkerError("bad_request", "group_init: rank 0 has no store (group_id first)")
    if store is None:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=SYNC_TIMEOUT)
    group = dist.ProcessGroupNCCL(dist.PrefixStore("relax-weight-sync", store), rank, world, SYNC_TIMEOUT)
    probe = torch.ones(1, device=state["device"])
    broadcast(group, probe)
    # The store stays with the group: rank 0's serves it, and NCCL's watchdog may still use it.
    state["sync"] = (group, store, rank)
    atexit.register(leave_group)
    return {"seconds": time.monotonic() - t0}


def broadcast(group, t):
    """`t` from rank 0 to every rank, finished on this device before it returns, so the one
    bucket buffer can take the next bucket."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()
    torch.cuda.current_stream().synchronize()


@torch.no_grad()
def broadcast_weights(p):
    """One update: rank 0 copies each bucket of its live weights into a device buffer and
    broadcasts it; the engines receive into theirs and copy it into their weights. Device to
    device, no host copy; the buffer is outside any region, as the host transport's staging."""
    if not state.get("sync"):
        raise rw.WorkerError("bad_request", "broadcast_weights before group_init")
    group, _, rank = state["sync"]
    bucket = p["bucket_bytes"]
    if bucket <= 0:
        raise rw.WorkerError("bad_request", "bucket_bytes must be positive")
    total = stream_bytes(state["model"])
    buckets = bucket_count(total, bucket)
    buf = torch.empty(max(1, min(bucket, total)), dtype=torch.uint8, device=state["device"])
    t0 = time.monotonic()
    for i in range(buckets):
        lo, hi = i * bucket, min(total, (i + 1) * bucket)
        pieces = list(stream_pieces(lo, hi))
        if rank == 0:
            for src, part, off in pieces:
                buf[off:off + part.stop - part.start].copy_(src[part])
        broadcast(group, buf[:hi - lo])
        if rank != 0:
            for dst, part, off in pieces:
                dst[part].copy_(buf[off:off + part.stop - part.start])
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    del buf
    torch.cuda.empty_cache()
    return {"bytes": total, "buckets": buckets, "seconds": seconds}


def leave_group():
    """Leaves the weight-sync group, once (group_destroy, shutdown, or the process's exit)."""
    sync = state.pop("sync", None)
    state.pop("sync_store", None)
    if sync:
        sync[0].shutdown()


def group_destroy(p):
    leave_group()
    return {}


def shutdown(p):
    leave_group()


def with_fault(handlers):
    """Test hook, as the built-in workers' (docs/worker-protocol.md, "Fault injection"):
    RELAX_WORKER_FAULT=METHOD:STEP:crash[:ROLE] aborts the process when METHOD's request of step
    STEP arrives, to test how the runner fails a run whose worker dies mid-phase. Never set in
    normal runs."""
    spec = os.environ.get("RELAX_WORKER_FAULT", "").split(":")
    if len(spec) < 3 or spec[0] not in handlers or spec[2] != "crash" or not spec[1].isdigit():
        return handlers
    if len(spec) > 3 and spec[3] != os.environ.get("RELAX_ROLE"):
        return handlers
    method, step, inner = spec[0], int(spec[1]), handlers[spec[0]]

    def faulty(p):
        if p.get("step", 0) == step:
            os.abort()
        return inner(p)
    return {**handlers, method: faulty}


if __name__ == "__main__":
    rw.serve(with_fault({
        "init": init, "checksum": checksum, "generate": generate, "log_probs": log_probs, "train": train,
        "values": values, "update_begin": update_begin, "pack": pack, "unpack": unpack,
        "update_end": update_end, "group_id": group_id, "group_init": group_init,
        "broadcast_weights": broadcast_weights, "group_destroy": group_destroy, "ipc_pid": ipc_pid,
        "ipc_export": ipc_export, "ipc_import": ipc_import, "ipc_pack": ipc_pack, "ipc_copy": ipc_copy,
        "ipc_close": ipc_close, "export_state": export_state, "import_state": import_state, "shutdown": shutdown,
    }), implementation="torch_worker.py (torch %s)" % torch.__version__)
