#!/usr/bin/env python3
"""An example external worker for `relax-colocate run` (docs/worker-protocol.md), both roles.

    relax-colocate run --trainer-cmd 'python3 scripts/example_worker.py' \
                       --rollout-cmd 'python3 scripts/example_worker.py'

The policy is a table of logits indexed by a hash of the context (prompt + response so far),
kept in device memory allocated through the runtime under the preloaded hook: tag "weights" (the
table), "ref" (the initial table), "grads"; the rollout's "kv_cache" holds its per-sequence
context hashes. The profile's allocations are made under their tags too (filled, not moved).
Training is GRPO's clipped surrogate with a KL loss, token-mean, plain SGD. A real integration
replaces the table with its model and keeps the same methods.
"""

import array
import hashlib
import math
import mmap
import os
import random
import struct
import zlib

# The runner's worker-protocol client: relax-colocate puts it on this process's PYTHONPATH
# (docs/worker-protocol.md).
import relax_worker as rw

ROWS = 4096
state = {}


def row(context):
    return zlib.crc32(struct.pack("<%dI" % len(context), *context)) % ROWS


def softmax(z):
    m = max(z)
    e = [math.exp(x - m) for x in z]
    s = sum(e)
    return [x / s for x in e]


def read_table(ptr):
    a = array.array("f")
    a.frombytes(state["dev"].read(ptr, state["table_bytes"]))
    return a


def write_table(ptr, a):
    state["dev"].write(ptr, a.tobytes())


def logits(table, context, temperature):
    r = row(context) * state["vocab"]
    return [table[r + j] / temperature for j in range(state["vocab"])]


def init(p):
    role = os.environ["RELAX_ROLE"]
    loss = p.get("loss") or {}
    if role == "trainer" and (loss.get("value_coef", 0) > 0 or loss.get("aggregation") != "token-mean"):
        raise rw.WorkerError("unsupported", "the example trainer does GRPO with token-mean aggregation only")
    if role == "trainer" and not p.get("backup", True):
        raise rw.WorkerError("unsupported", "the example trainer relies on the hook's CPU backup (memory.backup = true)")
    dev = rw.Device(p["api"], p["device"])
    vocab = p["shape"]["vocab"]
    state.update(dev=dev, role=role, vocab=vocab, table_bytes=ROWS * vocab * 4, loss=loss,
                 lr=(p.get("adam") or {}).get("lr", 0.05), pads=[], transfer=None)
    backup = role == "trainer"
    state["weights"] = dev.malloc(state["table_bytes"], "weights", backup)
    rng = random.Random(p["seed"])
    table = array.array("f", [rng.gauss(0.0, 0.01) for _ in range(ROWS * vocab)])
    if role == "trainer":
        write_table(state["weights"], table)
        state["ref"] = dev.malloc(state["table_bytes"], "ref", backup)
        write_table(state["ref"], table)
        state["grads"] = dev.malloc(state["table_bytes"], "grads", backup)
        state["snapshot"] = table.tobytes()
    else:
        state["kv"] = dev.malloc(max(1, p.get("max_batch", 1)) * 4, "kv_cache", False)
    for tag, sizes in p.get("memory", []):
        for size in sizes:
            ptr = dev.malloc(size, tag, backup)
            dev.write(ptr, os.urandom(min(size, 4096)))
            state["pads"].append(ptr)
    return {"params": ROWS * vocab}


def checksum(p):
    data = state["dev"].read(state["weights"], state["table_bytes"])
    return {"weights": hashlib.sha256(data).hexdigest()[:16], "bytes": len(data)}


def generate(p):
    """`n` samples per prompt; in async mode a sequence given a `responses` prefix continues after
    it and each request generates at most `segment_tokens` new tokens per sequence (the table
    needs no cache to refill: the context is the prompt and every token so far)."""
    table = read_table(state["weights"])
    rng = random.Random(p.get("seed", 0))
    n, max_new, eos = p["n"], p["max_new_tokens"], p.get("eos")
    responses = p.get("responses") or []
    if responses and len(responses) != len(p["prompts"]) * n:
        raise rw.WorkerError("bad_request", f"responses has {len(responses)} entries for {len(p['prompts']) * n} sequences")
    segment = p.get("segment_tokens") or max_new
    samples = []
    hashes = array.array("I")
    for i, prompt in enumerate(p["prompts"]):
        for s in range(n):
            prefix = list(responses[i * n + s]) if responses else []
            context, response, lps = list(prompt) + prefix, [], []
            finished = len(prefix) >= max_new
            for _ in range(min(segment, max_new - len(prefix))):
                probs = softmax(logits(table, context, p.get("temperature", 1.0)))
                tok = rng.choices(range(len(probs)), probs)[0]
                response.append(tok)
                lps.append(math.log(probs[tok]))
                context.append(tok)
                if tok == eos:
                    break
            finished = finished or eos in response or len(prefix) + len(response) >= max_new
            hashes.append(row(context))
            samples.append({"prompt_index": i, "response": response, "logprobs": lps, "finished": finished})
    state["dev"].write(state["kv"], hashes.tobytes()[: 4 * max(1, len(hashes))])
    return {"samples": samples}


def log_probs(p):
    table = read_table(state["ref"] if p.get("model") == "ref" else state["weights"])
    temperature = state["loss"].get("temperature", 1.0)
    out, ent = [], []
    for s in p["samples"]:
        context, lps, hs = list(s["prompt"]), [], []
        for tok in s["response"]:
            probs = softmax(logits(table, context, temperature))
            lps.append(math.log(probs[tok]))
            hs.append(-sum(q * math.log(q) for q in probs if q > 0))
            context.append(tok)
        out.append(lps)
        ent.append(hs)
    return {"logprobs": out, "entropy": ent}


def train(p):
    loss = state["loss"]
    clip = loss["clip"]
    temperature = loss.get("temperature", 1.0)
    kl_coef = loss.get("kl_coef", 0.0)
    table = read_table(state["weights"])
    grads = array.array("f", bytes(state["table_bytes"]))
    tokens = sum(len(s["response"]) for s in p["samples"]) or 1
    total, clipped, kl_sum, weight_sum = 0.0, 0, 0.0, 0.0
    for s in p["samples"]:
        context = list(s["prompt"])
        # The off-policy correction's per-token weights (docs/worker-protocol.md); none sent: 1.
        weights = s.get("is_weights") or [1.0] * len(s["response"])
        for t, tok in enumerate(s["response"]):
            z = logits(table, context, temperature)
            probs = softmax(z)
            logp = math.log(probs[tok])
            ratio = math.exp(max(-20.0, min(20.0, logp - s["old_logprobs"][t])))
            adv = s["advantages"][t]
            lo, hi = 1 - clip["eps_low"], 1 + clip["eps_high"]
            unclipped, clipped_loss = -adv * ratio, -adv * min(max(ratio, lo), hi)
            if clipped_loss > unclipped:
                clipped += 1
                g = -adv * ratio if lo < ratio < hi else 0.0
                total += weights[t] * clipped_loss
            else:
                g = -adv * ratio
                total += weights[t] * unclipped
            g *= weights[t]  # on the policy-gradient term only
            weight_sum += weights[t]
            x = logp - s["ref_logprobs"][t]  # k3 and its derivative
            kl_sum += math.exp(-x) - 1 + x
            g += kl_coef * (1 - math.exp(-x))
            r = row(context) * state["vocab"]
            for j in range(state["vocab"]):
                grads[r + j] += (g * ((1.0 if j == tok else 0.0) - probs[j]) / temperature) / tokens
            context.append(tok)
    write_table(state["grads"], grads)
    grads = read_table(state["grads"])
    lr = state["lr"] * 10  # a table needs bigger steps than the MLP the default lr is tuned for
    for i in range(len(table)):
        table[i] -= lr * grads[i]
    write_table(state["weights"], table)
    state["snapshot"] = table.tobytes()
    return {"pg_loss": total / tokens, "kl": kl_sum / tokens, "clip_frac": clipped / tokens,
            "tis_weight_mean": weight_sum / tokens}


def update_begin(p):
    f = open(p["shm"], "r+b")
    state["transfer"] = (f, mmap.mmap(f.fileno(), 0), p["bucket_bytes"],
                         state["dev"].malloc(min(p["bucket_bytes"], state["table_bytes"])))  # outside any region
    return {"buckets": -(-state["table_bytes"] // p["bucket_bytes"]), "bytes": state["table_bytes"]}


def bucket_range(i):
    b = state["transfer"][2]
    return i * b, min((i + 1) * b, state["table_bytes"])


def pack(p):
    f, m, b, staging = state["transfer"]
    lo, hi = bucket_range(p["bucket"])
    state["dev"].write(staging, state["snapshot"][lo:hi])
    m[0:hi - lo] = state["dev"].read(staging, hi - lo)
    return {"bytes": hi - lo}


def unpack(p):
    f, m, b, staging = state["transfer"]
    lo, hi = bucket_range(p["bucket"])
    state["dev"].write(staging, m[0:hi - lo])
    state["dev"].copy(state["weights"] + lo, staging, hi - lo)
    return {"bytes": hi - lo}


def update_end(p):
    f, m, b, staging = state["transfer"]
    m.close()
    f.close()
    state["dev"].free(staging)
    state["transfer"] = None
    return {}


if __name__ == "__main__":
    rw.serve({
        "init": init, "checksum": checksum, "generate": generate, "log_probs": log_probs, "train": train,
        "update_begin": update_begin, "pack": pack, "unpack": unpack, "update_end": update_end,
    }, implementation="example_worker.py")
