"""SGLang's, slime's and Relax's use of torch_memory_saver, re-enacted with real tensors on the simulated
device, once with torch_memory_saver 0.0.10's own preload library and once with libtms_hook.so
under its file name (the `which` parameter). The Python side is torch_memory_saver 0.0.10's own
package in both cases; only the preloaded library differs.

What the frameworks do (read for these tests; summarized, not copied)
=====================================================================

SGLang (sgl-project/sglang; the stored index holds these files at these commits)
- python/sglang/srt/torch_memory_saver_adapter.py (4ec1a30c553c; later versions seen in the index
  add `enable_cpu_backup`, `cuda_graph(**kw)` and `disable()` pass-throughs): the adapter is made by
  `TorchMemorySaverAdapter.create(enable=server_args.enable_memory_saver)`; the real adapter forwards
  `region(tag, enable_cpu_backup)` to `torch_memory_saver.region(tag=..., enable_cpu_backup=...)`,
  `pause(tag)`/`resume(tag)` to the singleton with `tag=` keyword, `configure_subprocess()` to the
  package's `configure_subprocess()`, and `enabled` to the singleton's `enabled` (always True).
  Some versions also force `hook_mode = "preload"` before first use.
- Model runner (python/sglang/srt/model_executor/model_runner.py, recent versions; also visible in
  slime's docker/patch/v0.5.5.post1/sglang.patch at slime 624b824a): the model is loaded inside
  `region(GPU_MEMORY_TYPE_WEIGHTS="weights", enable_cpu_backup=server_args.enable_weights_cpu_backup)`
  (default False; draft models get backup with `enable_draft_weights_cpu_backup`). The KV pools and
  the req-to-token table are allocated inside `region("kv_cache")` without backup; CUDA graphs are
  captured through `cuda_graph(...)` with tag "cuda_graph" when SGLANG_MEMORY_SAVER_CUDA_GRAPH is set.
- Scheduler (python/sglang/srt/managers/scheduler_update_weights_mixin.py @ c20e3fec6e80; newer
  copies in the index add idleness and weight-cache checks around the same order):
  release_memory_occupation(tags or all): if kv_cache: pause("kv_cache") then flush_cache() (the
  radix tree and token allocator are reset; the allocator's free list is re-made on the device);
  if weights: the model's named buffers are cloned (`_export_static_state`), a TP barrier, then
  pause("weights"); if cuda_graph: pause("cuda_graph"); finally a device synchronize. No
  `empty_cache`. resume_memory_occupation(tags or all): resume("cuda_graph"), then resume("weights")
  followed by copying the stashed buffers back into the model (`_import_static_state`), then
  resume("kv_cache").
- Weight updates into a running engine (update_weights_from_tensor) receive tensors serialized with
  torch.multiprocessing's reductions (MultiprocessingSerializer = ForkingPickler bytes, CUDA tensors
  as CUDA IPC handles) and copy them into the model's parameters.

slime (THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515)
- slime/ray/actor_group.py: with --offload-train on the Megatron backend, trainer processes get
  LD_PRELOAD=<site-packages>/torch_memory_saver_hook_mode_preload_cu13.abi3.so (cu12, plain as
  fallbacks), TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1: every device allocation of the
  process is pauseable with backup.
- docker/patch/latest/megatron.patch: Megatron's DDP param and grad buffers are allocated inside
  `torch_memory_saver.region(tag="param_buffer"/"grad_buffer", enable_cpu_backup=False)` when
  disable_{param,grad}_buffers_cpu_backup (slime_validate_args forces both on with offload_train).
- slime/backends/megatron_utils/actor.py: a TensorBackuper keeps pinned CPU copies of the params
  (backup("actor") after init and after every train); sleep() = synchronize + gc + empty_cache +
  torch._C._host_emptyCache, destroy process groups, `torch_memory_saver.pause()` (untagged);
  wake_up() = `torch_memory_saver.resume()`, synchronize + gc + empty_cache, reload process groups,
  restore the params from the TensorBackuper ("actor"). train(): wake_up, train, backup, sleep.
  update_weights() runs while the trainer sleeps, inside `torch_memory_saver.disable()` (fresh
  MemPool, interesting_region off) so its transfer buffers are plain device memory.
- slime/backends/megatron_utils/update_weight/common.py: `_maybe_get_cpu_backup(x)` returns
  `torch_memory_saver.get_cpu_backup(x, zero_copy=True)` when non-None, else x; used when
  named_params_and_buffers(translate_gpu_to_cpu=True). From d4c6dcc3 (2025-11-30) to d3490718
  (2026-05-27) the actor used it (with --disable-weights-backuper) to read the sleeping trainer's
  weights out of torch_memory_saver's CPU backup instead of a separate pinned copy.
- update_weight/update_weight_from_tensor.py (colocated): per bucket, the HF-named tensors are
  flattened into one device tensor (FlattenedTensorBucket), serialized with MultiprocessingSerializer
  (CUDA IPC), gathered over Gloo and sent to the engine's update_weights_from_tensor; then
  ipc_collect + empty_cache.
- slime/backends/megatron_utils/__init__.py: DeepEP buffers are created with
  `torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region(False)` around them
  (restored after), so they are never paused.
- train.py / slime/ray/rollout.py: per rollout: generate; rollout offload = the engine's
  flush_cache + release_memory_occupation() (all tags); actor train (wake_up .. sleep); rollout
  onload_weights = resume_memory_occupation(["weights"]); actor update_weights; rollout onload_kv =
  resume_memory_occupation(["kv_cache", "cuda_graph"]). SGLang engines get
  enable_memory_saver=offload_rollout and never enable_weights_cpu_backup (new weights are pushed
  right after the weights come back).

Relax (redai-infra/Relax; docs/ray.md cites the files and commits read) keeps slime's trainer:
relax/distributed/ray/actor_group.py preloads <site-packages>/torch_memory_saver_hook_mode_preload.abi3.so
(the unversioned name, after checking the file exists) with TMS_INIT_ENABLE=1 and
TMS_INIT_ENABLE_CPU_BACKUP=1 under --offload-train; relax/backends/megatron/actor.py sets
memory_margin_bytes from --train-memory-margin-bytes, sleeps with pause() and wakes with resume()
as slime does. Its rollout engines are SGLang's, driven as slime drives them.

Not re-enacted here: hook_mode "torch" (it loads the wheel's torch-mode library, which this file
does not replace). Both variants train with autograd's worker threads: their first runtime call
is cudaStreamIsCapturing, which makes the primary context current (as on a GPU; the simulator
once did not, and upstream's library exits its process on an allocation without a context).
"""

from pathlib import Path

import pytest
from variants import SITE, UPSTREAM_PRELOAD, WHICH
from variants import preload_for as _preload

MIB = 1 << 20


def _trainer_env(extra=None):
    env = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------
# a. SGLang rollout engine: load weights and KV pool in their regions, release, resume.
# --------------------------------------------------------------------------------------------

SGLANG_ENGINE = """
import torch, torch_memory_saver
from torch import nn

WEIGHTS_BACKUP = {weights_backup}
MIB = 1 << 20
saver = torch_memory_saver.torch_memory_saver


class Adapter:
    # What SGLang's real adapter forwards to the singleton.
    def region(self, tag, enable_cpu_backup=False):
        return saver.region(tag=tag, enable_cpu_backup=enable_cpu_backup)

    def pause(self, tag):
        return saver.pause(tag=tag)

    def resume(self, tag):
        return saver.resume(tag=tag)

    @property
    def enabled(self):
        return saver is not None and saver.enabled


class TinyLM(nn.Module):
    def __init__(self, vocab=2048, hidden=256, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.ups = nn.ModuleList(nn.Linear(hidden, 4 * hidden) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(4 * hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        # A non-parameter buffer, as rotary tables are: SGLang stashes buffers across a release.
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))

    def forward(self, ids):
        h = self.embed(ids)
        for up, down in zip(self.ups, self.downs):
            h = h + down(torch.nn.functional.gelu(up(h)))
        return self.head(h) + self.inv_freq.sum()


def free():
    return torch.cuda.mem_get_info()[0]


adapter = Adapter()
print("enabled=%s" % adapter.enabled)
torch.manual_seed(0)
cpu_model = TinyLM()
reference = {{k: v.clone() for k, v in cpu_model.state_dict().items()}}

r0 = torch.cuda.memory_reserved()
with adapter.region("weights", enable_cpu_backup=WEIGHTS_BACKUP):
    model = TinyLM().cuda()
    model.load_state_dict(reference)
r1 = torch.cuda.memory_reserved()
with adapter.region("kv_cache"):
    req_to_token = torch.zeros((64, 1024), dtype=torch.int32, device="cuda")
    k_buffers = [torch.zeros((4096, 4, 64), dtype=torch.float16, device="cuda") for _ in range(2)]
    v_buffers = [torch.zeros((4096, 4, 64), dtype=torch.float16, device="cuda") for _ in range(2)]
r2 = torch.cuda.memory_reserved()
# The token allocator's free list lives outside the regions and is re-made by flush_cache.
free_pages = torch.arange(1, 4097, dtype=torch.int64, device="cuda")

ids = torch.randint(0, 2048, (4, 16), device="cuda")
with torch.no_grad():
    before = model(ids).cpu()
    k_buffers[0][:64].copy_(torch.randn(64, 4, 64).half())
torch.cuda.synchronize()
ptrs = [p.data_ptr() for p in model.parameters()] + [t.data_ptr() for t in k_buffers + v_buffers]

# release_memory_occupation(tags=None)
f0 = free()
adapter.pause("kv_cache")
free_pages = torch.arange(1, 4097, dtype=torch.int64, device="cuda")  # flush_cache
f1 = free()
stashed = [(n, b.detach().clone()) for n, b in model.named_buffers()]  # _export_static_state
{settle}adapter.pause("weights")
torch.cuda.synchronize()
f2 = free()

# resume_memory_occupation(tags=None): weights (+ buffers back), then kv_cache
adapter.resume("weights")
named = dict(model.named_buffers())
with torch.inference_mode():
    for n, t in stashed:
        named[n][...] = t
f3 = free()
adapter.resume("kv_cache")
f4 = free()

if not WEIGHTS_BACKUP:
    # What slime does next: push the weights (update_weights_from_tensor copies into the params).
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reference[n].cuda())

print("reserved_weights=%d" % (r1 - r0))
print("reserved_kv=%d" % (r2 - r1))
print("freed_kv=%d" % (f1 - f0))
print("freed_weights=%d" % (f2 - f1))
print("regained_weights=%d" % (f2 - f3))
print("regained_kv=%d" % (f3 - f4))
print("net=%d" % (f4 - f0))
same_ptrs = ptrs == [p.data_ptr() for p in model.parameters()] + [t.data_ptr() for t in k_buffers + v_buffers]
print("same_ptrs=%s" % same_ptrs)
state = model.state_dict()
print("weights_same=%s" % all(torch.equal(state[k].cpu(), v) for k, v in reference.items()))
print("buffer_same=%s" % torch.equal(model.inv_freq.cpu(), reference["inv_freq"]))
with torch.no_grad():
    after = model(ids).cpu()
print("forward_same=%s" % torch.equal(before, after))
# The KV pool is usable again (its contents are not kept: no backup).
k_buffers[1][:8].fill_(1.5)
req_to_token[0, :4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
kv_ok = k_buffers[1][:8].float().sum().item() == 8 * 4 * 64 * 1.5
print("kv_usable=%s" % bool(kv_ok and req_to_token[0, :4].sum().item() == 10))
"""


@pytest.mark.parametrize("which", WHICH, indirect=True)
@pytest.mark.parametrize("weights_backup", [True, False], ids=["weights_cpu_backup", "weights_no_backup"])
def test_sglang_release_and_resume_memory_occupation(sim, which, weights_backup):
    # The stash's clones are device-to-device copies queued on stream 0, still reading the
    # weights' buffers when the pause comes. Ours waits for the queued work before it unmaps.
    # Upstream's pause unmaps at once unless a backup copy (a synchronous cudaMemcpy on the same
    # stream) came first, so without a backup the clone may read unmapped memory: 700, sticky.
    # On a GPU the same race is hidden by cuMemUnmap's "synchronous behavior for most use cases";
    # here it shows, so upstream gets the synchronize that SGLang would need with it.
    settle = "torch.cuda.synchronize()\n" if which == "upstream" and not weights_backup else ""
    code = SGLANG_ENGINE.format(weights_backup=weights_backup, settle=settle)
    out = sim.ok(code, preload=_preload(sim, which), memory="2GiB")
    assert out["enabled"] == "True"
    assert int(out["reserved_weights"]) >= 8 * MIB, out
    assert int(out["reserved_kv"]) >= 8 * MIB, out
    # Every byte of each region comes back to the device at its pause, and is taken again at resume.
    assert int(out["freed_kv"]) == int(out["reserved_kv"]), out
    assert int(out["freed_weights"]) == int(out["reserved_weights"]), out
    assert int(out["regained_weights"]) == int(out["reserved_weights"]), out
    assert int(out["regained_kv"]) == int(out["reserved_kv"]), out
    assert int(out["net"]) == 0, out
    assert out["same_ptrs"] == "True"
    assert out["weights_same"] == "True"
    assert out["buffer_same"] == "True"
    assert out["forward_same"] == "True"
    assert out["kv_usable"] == "True"


# --------------------------------------------------------------------------------------------
# b. slime trainer: whole process tracked with backup, untagged sleep/wake between steps.
# --------------------------------------------------------------------------------------------

SLIME_TRAINER = """
import copy, gc, torch, torch_memory_saver
from torch import nn

LAYOUT = {layout!r}
MIB = 1 << 20
saver = torch_memory_saver.torch_memory_saver
MARGIN = {margin}
if MARGIN:  # --train-memory-margin-bytes (slime and Relax set it at actor init when > 0)
    saver.memory_margin_bytes = MARGIN  # a setter only, in torch_memory_saver 0.0.10


def clear_memory(clear_host_memory=False):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    if clear_host_memory and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def free():
    return torch.cuda.mem_get_info()[0]


torch.manual_seed(0)
CPU_MODEL = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
DATA = [(torch.randn(64, 512), torch.randn(64, 512)) for _ in range(2)]
PARAM_BYTES = sum(p.numel() * 4 for p in CPU_MODEL.parameters())


class Trainer:
    def __init__(self):
        self.model = copy.deepcopy(CPU_MODEL).cuda()
        self.grad_buffer = None
        if LAYOUT == "megatron_buffers":
            # Megatron with slime's patch: params and grads live in two contiguous buffers made in
            # regions without backup; the params are restored from pinned copies at wake-up.
            total = sum(p.numel() for p in self.model.parameters())
            with saver.region(tag="param_buffer", enable_cpu_backup=False):
                self.param_buffer = torch.empty(total, device="cuda")
            with saver.region(tag="grad_buffer", enable_cpu_backup=False):
                self.grad_buffer = torch.zeros(total, device="cuda")
            offset = 0
            for p in self.model.parameters():
                n = p.numel()
                view = self.param_buffer[offset:offset + n].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.grad = self.grad_buffer[offset:offset + n].view_as(p)
                offset += n
            # DeepEP-like communication buffer: made with the region flag off, through the
            # library handle as slime's patch does, in a pool of its own (fresh device memory).
            cdll = saver._impl._binary_wrapper.cdll
            was = cdll.tms_get_interesting_region()
            cdll.tms_set_interesting_region(False)
            try:
                self.comm_pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(self.comm_pool):
                    self.comm = torch.full((4 * MIB,), 7, dtype=torch.uint8, device="cuda")
            finally:
                cdll.tms_set_interesting_region(was)
            print("region_flag_restored=%s" % (cdll.tms_get_interesting_region() == was))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.backup = {{}}
        self.backup_actor()

    def backup_actor(self):  # TensorBackuper.backup("actor")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n not in self.backup:
                    self.backup[n] = torch.empty_like(p, device="cpu", pin_memory=True)
                self.backup[n].copy_(p.detach(), non_blocking=True)
        torch.cuda.synchronize()

    def restore_actor(self):  # TensorBackuper.restore("actor")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.backup[n], non_blocking=True)
        torch.cuda.synchronize()

    def sleep(self):
        clear_memory(clear_host_memory=True)
        f0 = free()
        saver.pause()
        return free() - f0

    def wake_up(self):
        f0 = free()
        saver.resume()
        taken = f0 - free()
        clear_memory()
        self.restore_actor()
        return taken

    def step(self, i):
        x, y = (t.cuda() for t in DATA[i])
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.backup_actor()
        return loss.item()

    def params(self):
        return [p.detach().cpu().clone() for p in self.model.parameters()]


# Reference: the same two steps, never paused.
ref = Trainer()
ref_losses = [ref.step(0), ref.step(1)]
ref_params = ref.params()
del ref
clear_memory()

# slime: init ends asleep; each train() wakes up, trains, backs up, sleeps.
t = Trainer()
freed_init = t.sleep()
t.wake_up()
loss0 = t.step(0)
freed = t.sleep()
if LAYOUT == "megatron_buffers":
    print("comm_kept=%s" % bool((t.comm.cpu() == 7).all().item()))
taken = t.wake_up()
loss1 = t.step(1)
freed_again = t.sleep()
t.wake_up()
print("param_bytes=%d" % PARAM_BYTES)
print("freed_init=%d" % freed_init)
print("freed=%d" % freed)
print("taken=%d" % taken)
print("freed_again=%d" % freed_again)
print("losses_same=%s" % ([loss0, loss1] == ref_losses))
print("params_same=%s" % all(torch.equal(a, b) for a, b in zip(t.params(), ref_params)))
state = [s for s in t.opt.state.values()]
print("adam_steps=%s" % [int(s["step"]) for s in state][:1])
if MARGIN:
    # Every allocation is in a region (TMS_INIT_ENABLE=1): one that would leave less than the
    # margin free is refused, a smaller one is not.
    clear_memory()
    try:
        torch.empty(free() - MARGIN // 2, dtype=torch.uint8, device="cuda")
        print("margin_kept=False")
    except torch.OutOfMemoryError:
        print("margin_kept=True")
    clear_memory()
    x = torch.empty(free() - 2 * MARGIN, dtype=torch.uint8, device="cuda")
    print("below_margin_ok=True")
"""


@pytest.mark.parametrize("which", WHICH, indirect=True)
@pytest.mark.parametrize("layout", ["whole_process", "megatron_buffers"])
def test_slime_trainer_sleep_and_wake_up_between_steps(sim, which, layout):
    code = SLIME_TRAINER.format(layout=layout, margin=0)
    out = sim.ok(code, preload=_preload(sim, which), memory="2GiB", extra=_trainer_env())
    _check_trainer(out, layout)


def _check_trainer(out, layout):
    param_bytes = int(out["param_bytes"])
    # After a step: params, grads and AdamW's two moments (at least) are released by the pause.
    assert int(out["freed_init"]) >= param_bytes, out
    assert int(out["freed"]) >= 4 * param_bytes, out
    assert int(out["taken"]) == int(out["freed"]), out
    assert int(out["freed_again"]) == int(out["freed"]), out
    assert out["losses_same"] == "True", out
    assert out["params_same"] == "True", out
    assert out["adam_steps"] == "[2]", out
    if layout == "megatron_buffers":
        assert out["region_flag_restored"] == "True"
        assert out["comm_kept"] == "True"


@pytest.mark.parametrize("which", WHICH, indirect=True)
def test_relax_trainer_with_its_preload_name_and_a_margin(sim, which):
    # Relax (redai-infra/Relax, relax/distributed/ray/actor_group.py and
    # relax/backends/megatron/actor.py; docs/ray.md) runs slime's trainer cycle but preloads the
    # unversioned library name, checking that the file exists, and sets memory_margin_bytes from
    # --train-memory-margin-bytes before building the model.
    preload = _preload(sim, which).with_name("torch_memory_saver_hook_mode_preload.abi3.so")
    assert preload.exists(), preload
    code = SLIME_TRAINER.format(layout="whole_process", margin=256 * MIB)
    out = sim.ok(code, preload=preload, memory="2GiB", extra=_trainer_env())
    _check_trainer(out, "whole_process")
    assert out["margin_kept"] == "True", out
    assert out["below_margin_ok"] == "True", out


# --------------------------------------------------------------------------------------------
# c. slime update-weights reading the sleeping trainer's weights from get_cpu_backup.
# --------------------------------------------------------------------------------------------

SLIME_CPU_BACKUP = """
import gc, torch, torch_memory_saver
from torch import nn

RETAIN = {retain}
saver = torch_memory_saver.torch_memory_saver


def maybe_get_cpu_backup(x):  # slime's _maybe_get_cpu_backup
    cpu = saver.get_cpu_backup(x, zero_copy=True)
    return cpu if cpu is not None else x


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step():
    x, y = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    torch.cuda.synchronize()


train_step()
snapshot = {{n: p.detach().cpu().clone() for n, p in model.named_parameters()}}
print("backup_while_active=%s" % any(saver.get_cpu_backup(p) is not None for p in model.parameters()))

torch.cuda.synchronize(); gc.collect(); torch.cuda.empty_cache()
saver.pause()

# update_weights while asleep: inside disable(), weights come from the CPU backup.
with saver.disable():
    named = [(n, maybe_get_cpu_backup(p)) for n, p in model.named_parameters()]
    print("all_from_backup=%s" % all(t.device.type == "cpu" for _, t in named))
    print("backup_equal=%s" % all(torch.equal(t, snapshot[n]) for n, t in named))
    copied = {{n: saver.get_cpu_backup(p) for n, p in model.named_parameters()}}
    print("copy_equal=%s" % all(torch.equal(t, snapshot[n]) for n, t in copied.items()))
    bucket = torch.cat([t.to("cuda").reshape(-1) for _, t in named])
    print("bucket_equal=%s" % torch.equal(bucket.cpu(), torch.cat([snapshot[n].reshape(-1) for n, _ in named])))
    del named, bucket
    torch.cuda.empty_cache()

if RETAIN:
    saver.retain_cpu_backup = True
saver.resume()
print("retain_flag=%s" % saver.retain_cpu_backup)
after = [saver.get_cpu_backup(p) for p in model.parameters()]
print("backup_after_resume=%s" % [a is not None for a in after].count(True))
if RETAIN:
    print("retained_equal=%s" % all(torch.equal(a, snapshot[n]) for a, (n, _) in zip(after, model.named_parameters())))
print("resumed_equal=%s" % all(torch.equal(p.detach().cpu(), snapshot[n]) for n, p in model.named_parameters()))

# Train on: a retained backup is the last pause's snapshot, not the live weights.
train_step()
if RETAIN:
    stale = [saver.get_cpu_backup(p) for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    print("retained_is_snapshot=%s" % all(torch.equal(a, snapshot[n]) for a, n in zip(stale, names)))
    saver.retain_cpu_backup = False
live = {{n: p.detach().cpu().clone() for n, p in model.named_parameters()}}
saver.pause()
backups = {{n: saver.get_cpu_backup(p) for n, p in model.named_parameters()}}
print("second_pause_backup=%s" % all(torch.equal(b, live[n]) for n, b in backups.items()))
saver.resume()
print("second_resume_equal=%s" % all(torch.equal(p.detach().cpu(), live[n]) for n, p in model.named_parameters()))
"""


@pytest.mark.parametrize("which", WHICH, indirect=True)
@pytest.mark.parametrize("retain", [False, True], ids=["no_retain", "retain"])
def test_slime_update_weights_from_cpu_backup(sim, which, retain):
    code = SLIME_CPU_BACKUP.format(retain=retain)
    out = sim.ok(code, preload=_preload(sim, which), memory="2GiB", extra=_trainer_env())
    assert out["backup_while_active"] == "False", out
    assert out["all_from_backup"] == "True", out
    assert out["backup_equal"] == "True", out
    assert out["copy_equal"] == "True", out
    assert out["bucket_equal"] == "True", out
    assert out["retain_flag"] == str(retain), out
    assert out["resumed_equal"] == "True", out
    if retain:
        assert out["backup_after_resume"] == "4", out
        assert out["retained_equal"] == "True", out
        assert out["retained_is_snapshot"] == "True", out
    else:
        assert out["backup_after_resume"] == "0", out
    assert out["second_pause_backup"] == "True", out
    assert out["second_resume_equal"] == "True", out


# --------------------------------------------------------------------------------------------
# d. Colocated weight handover: trainer (asleep) -> CUDA IPC -> rollout engine's weights region.
# --------------------------------------------------------------------------------------------

SLIME_IPC_HANDOVER = """
import gc, os, queue
import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
from torch import nn

MIB = 1 << 20


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def free():
    return torch.cuda.mem_get_info()[0]


def rollout_engine(cmd_q, res_q):
    # SGLang scheduler of a slime rollout engine: memory saver on, no weights backup.
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    try:
        with saver.region(tag="weights", enable_cpu_backup=False):
            model = make_model(1).cuda()  # stale initial weights, replaced by the handover
        with saver.region(tag="kv_cache", enable_cpu_backup=False):
            kv = torch.zeros(4 * MIB, device="cuda")
        ptrs = [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()]
        init_enable = os.environ.get("TMS_INIT_ENABLE")
        parent = os.getppid()
        while True:
            try:
                cmd, arg = cmd_q.get(timeout=2)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone
                    return
                continue
            if cmd == "noop":
                res_q.put(("ready", init_enable))
            elif cmd == "release":
                f0 = free()
                saver.pause(tag="kv_cache")
                saver.pause(tag="weights")
                torch.cuda.synchronize()
                res_q.put(("released", free() - f0))
            elif cmd == "resume":
                f0 = free()
                for tag in arg:
                    saver.resume(tag=tag)
                res_q.put(("resumed", f0 - free()))
            elif cmd == "update_weights_from_tensor":
                data = ForkingPickler.loads(arg)  # MultiprocessingSerializer.deserialize
                flat, meta = data["flattened_tensor"], data["metadata"]
                with torch.no_grad():
                    params = dict(model.named_parameters())
                    for name, shape, offset, numel in meta:
                        params[name].copy_(flat[offset:offset + numel].view(shape))
                torch.cuda.synchronize()
                del data, flat
                res_q.put(("updated", None))
            elif cmd == "generate":
                with torch.no_grad():
                    out = model(arg.cuda()).cpu()
                same = ptrs == [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()]
                res_q.put(("generated", (out, same)))
            elif cmd == "exit":
                res_q.put(("bye", None))
                return
    except BaseException as e:
        res_q.put(("error", repr(e)))
        raise


def ask(cmd_q, res_q, cmd, arg=None):
    cmd_q.put((cmd, arg))
    while True:
        try:
            kind, value = res_q.get(timeout=2)
            break
        except queue.Empty:
            if not engine.is_alive():
                raise RuntimeError("rollout engine died: exit %s" % engine.exitcode)
    if kind == "error":
        raise RuntimeError("rollout engine: " + value)
    return value


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    # The engine is a process of its own without the trainer's TMS_INIT_* (as in slime).
    saved = {{k: os.environ.pop(k) for k in ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP")}}
    engine = ctx.Process(target=rollout_engine, args=(cmd_q, res_q), daemon=True)
    engine.start()
    os.environ.update(saved)
    print("engine_init_enable=%s" % ask(cmd_q, res_q, "noop"))

    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver

    x = torch.randn(8, 256)

    # Rollout offload (release_memory_occupation, all tags).
    print("engine_released=%d" % ask(cmd_q, res_q, "release"))

    # Actor train (awake), then sleep.
    model = make_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)
    loss = torch.nn.functional.mse_loss(model(torch.randn(16, 256, device="cuda")), torch.randn(16, 256, device="cuda"))
    loss.backward()
    opt.step()
    torch.cuda.synchronize(); gc.collect(); torch.cuda.empty_cache()
    f0 = free()
    saver.pause()
    print("trainer_freed=%d" % (free() - f0))

    # Rollout onload_weights.
    print("engine_weights_back=%d" % ask(cmd_q, res_q, "resume", ["weights"]))

    # Actor update_weights: asleep, transfer buffer made inside disable(), sent by CUDA IPC.
    with saver.disable():
        named = []
        for n, p in model.named_parameters():
            cpu = saver.get_cpu_backup(p, zero_copy=True)
            named.append((n, cpu if cpu is not None else p))
        print("from_backup=%s" % all(t.device.type == "cpu" for _, t in named))
        flat = torch.cat([t.to("cuda").reshape(-1) for _, t in named])
        meta, offset = [], 0
        for n, t in named:
            meta.append((n, tuple(t.shape), offset, t.numel()))
            offset += t.numel()
        payload = bytes(ForkingPickler.dumps({{"flattened_tensor": flat, "metadata": meta}}))
        ask(cmd_q, res_q, "update_weights_from_tensor", payload)
        del named, flat, payload
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    print("handed_over=True")

    # Rollout onload_kv, then generate with the new weights.
    print("engine_kv_back=%d" % ask(cmd_q, res_q, "resume", ["kv_cache"]))
    out, same_ptrs = ask(cmd_q, res_q, "generate", x)
    print("engine_same_ptrs=%s" % same_ptrs)

    # The trainer wakes up and computes the same forward with its own weights.
    saver.resume()
    with torch.no_grad():
        expected = model(x.cuda()).cpu()
    print("engine_matches_trainer=%s" % torch.equal(out, expected))
    ask(cmd_q, res_q, "exit")
    engine.join(60)
    print("engine_exit=%s" % engine.exitcode)
"""


@pytest.mark.parametrize("which", WHICH, indirect=True)
def test_slime_weight_handover_by_cuda_ipc(sim, which):
    out = sim.ok(
        SLIME_IPC_HANDOVER.format(),
        preload=_preload(sim, which),
        memory="2GiB",
        extra=_trainer_env(),
        as_file=True,
        timeout=300,
    )
    assert out["engine_init_enable"] == "None", out
    assert int(out["engine_released"]) >= 5 * MIB, out
    assert int(out["trainer_freed"]) >= 4 * MIB, out
    assert int(out["engine_weights_back"]) >= MIB, out
    assert out["from_backup"] == "True", out
    assert out["handed_over"] == "True", out
    assert int(out["engine_kv_back"]) >= 4 * MIB, out
    assert out["engine_same_ptrs"] == "True", out
    assert out["engine_matches_trainer"] == "True", out
    assert out["engine_exit"] == "0", out


# --------------------------------------------------------------------------------------------
# f. SGLang with SGLANG_MEMORY_SAVER_CUDA_GRAPH (set by slime): graphs captured under the
#    "cuda_graph" tag, released and resumed with the weights and the KV pool, then replayed.
# --------------------------------------------------------------------------------------------

SGLANG_CUDA_GRAPHS = """
import torch, torch_memory_saver
from torch import nn

saver = torch_memory_saver.torch_memory_saver


def free():
    return torch.cuda.mem_get_info()[0]


torch.manual_seed(0)
with saver.region(tag="weights", enable_cpu_backup=True):
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
with saver.region(tag="kv_cache"):
    kv = torch.zeros((64, 256), device="cuda")

# The graph runner's static buffers live outside the regions.
max_bs = 8
static_x = torch.randn(max_bs, 256, device="cuda")
slots = torch.arange(max_bs, device="cuda")


def decode(bs):
    h = model(static_x[:bs])
    kv.index_copy_(0, slots[:bs], h)  # the step writes its keys into the pool
    return h * 2


def pool_bytes(pool):
    # The graphs' private pool: the caching allocator's segments for it, all made in the
    # cuda_graph region. (Free memory drops by more on a GPU: kernel modules, cuBLAS' workspace
    # and the graphs' own driver memory, none of which any saver can release.)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id") or ()) == tuple(pool))


stream = torch.cuda.Stream()
graphs, outs, pool = {{}}, {{}}, None
for bs in (8, 4):  # largest first, one memory pool shared by every batch size
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            decode(bs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), saver.cuda_graph(cuda_graph=g, pool=pool, stream=stream, tag="cuda_graph"):
        outs[bs] = decode(bs)
    pool = g.pool()
    graphs[bs] = g
torch.cuda.synchronize()
print("graph_bytes=%d" % pool_bytes(pool))

expected = {{}}
for bs, g in graphs.items():
    g.replay()
    torch.cuda.synchronize()
    expected[bs] = (outs[bs].cpu().clone(), kv[:bs].cpu().clone())

# release_memory_occupation(all): kv_cache, weights, cuda_graph; then a device synchronize.
f0 = free()
saver.pause(tag="kv_cache")
saver.pause(tag="weights")
f1 = free()
saver.pause(tag="cuda_graph")
torch.cuda.synchronize()
f2 = free()
# resume_memory_occupation(all): cuda_graph, weights, kv_cache.
saver.resume(tag="cuda_graph")
saver.resume(tag="weights")
saver.resume(tag="kv_cache")
f3 = free()
kv.zero_()  # flush: the pool's old contents mean nothing now
print("freed_graph=%d" % (f2 - f1))
print("freed_all=%d" % (f2 - f0))
print("regained=%d" % (f2 - f3))
same = []
for bs, g in graphs.items():
    g.replay()
    torch.cuda.synchronize()
    same.append(torch.equal(outs[bs].cpu(), expected[bs][0]) and torch.equal(kv[:bs].cpu(), expected[bs][1]))
print("replays_same=%s" % all(same))
"""


@pytest.mark.parametrize("which", WHICH, indirect=True)
def test_sglang_cuda_graphs_under_the_cuda_graph_tag(sim, which):
    out = sim.ok(SGLANG_CUDA_GRAPHS.format(), preload=_preload(sim, which), memory="2GiB")
    assert int(out["graph_bytes"]) > 0, out
    assert int(out["freed_graph"]) == int(out["graph_bytes"]), out
    assert int(out["regained"]) == int(out["freed_all"]), out
    assert out["replays_same"] == "True", out


# --------------------------------------------------------------------------------------------
# e. SGLang's Engine starts its scheduler under configure_subprocess(): the child preloads the
#    library the Python package finds next to itself. With our library, `tms-ctl list` (the
#    README quickstart's check) shows the scheduler by the TMS_NAME it inherited, tag resident.
# --------------------------------------------------------------------------------------------

SGLANG_CONFIGURE_SUBPROCESS = """
import os, queue, subprocess
import torch.multiprocessing as mp


def scheduler(q, seen):
    import torch, torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    try:
        with saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.arange(4 << 20, dtype=torch.int32, device="cuda")
        f0 = torch.cuda.mem_get_info()[0]
        saver.pause(tag="weights")
        freed = torch.cuda.mem_get_info()[0] - f0
        saver.resume(tag="weights")
        same = bool(torch.equal(w.cpu(), torch.arange(4 << 20, dtype=torch.int32)))
        maps = [line.split()[-1] for line in open("/proc/self/maps")]
        libs = sorted({{m for m in maps if ("tms_hook" in m or "torch_memory_saver" in m) and ".so" in m}})
        q.put((os.environ.get("LD_PRELOAD", ""), freed, same, libs))
        # The scheduler stays up, its weights resident, while the parent asks tms-ctl about it.
        seen.wait(120)
    except BaseException as e:
        q.put(("error", repr(e), False, []))


if __name__ == "__main__":
    import torch_memory_saver
    print("parent_preload=%s" % os.environ.get("LD_PRELOAD", ""))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    seen = ctx.Event()
    with torch_memory_saver.configure_subprocess():
        p = ctx.Process(target=scheduler, args=(q, seen))
        p.start()
    while True:
        try:
            preload, freed, same, libs = q.get(timeout=2)
            break
        except queue.Empty:
            if not p.is_alive():
                raise SystemExit("scheduler died: exit %s" % p.exitcode)
    ctl = os.environ.get("CTL")
    if ctl:
        # What the README's quickstart asks during a job: the hooked scheduler, by its name.
        listed = subprocess.run([ctl, "list"], capture_output=True, text=True, timeout=60)
        print("ctl_rc=%s" % listed.returncode)
        print("ctl_list=%s" % listed.stdout.replace("\\n", "|"))
    seen.set()
    p.join(60)
    print("child_preload=%s" % preload)
    print("child_freed=%s" % freed)
    print("child_same=%s" % same)
    print("child_libs=%s" % ",".join(libs))
    print("child_exit=%s" % p.exitcode)
"""


def _wheel_layout(sim, which):
    """A site folder that carries torch_memory_saver's package and, next to it, the preload
    library the package looks for: the wheel's own file, or our hook installed under its name."""
    if which == "upstream":
        return SITE, SITE / UPSTREAM_PRELOAD
    if which == "wheel":
        site = Path(sim.python_path[0])
        return site, site / UPSTREAM_PRELOAD
    site = sim.tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "torch_memory_saver").symlink_to(SITE / "torch_memory_saver", target_is_directory=True)
    (site / UPSTREAM_PRELOAD).symlink_to(sim.hook)
    return site, sim.hook


@pytest.mark.parametrize("which", WHICH, indirect=True)
def test_sglang_scheduler_started_under_configure_subprocess(sim, which):
    site, lib = _wheel_layout(sim, which)
    extra = {"PYTHONPATH": f"{sim.sim_python}:{site}", "PYTHONDONTWRITEBYTECODE": "1"}
    if which != "upstream":
        from test_nccl_pause import _ctl_binary

        # The scheduler inherits the launcher's environment, as SGLang's do: its name and the
        # socket folder tms-ctl looks in.
        control = sim.tmp / "control"
        control.mkdir(mode=0o700)
        extra.update(CTL=str(_ctl_binary(sim.hook)), TMS_CONTROL_DIR=str(control), TMS_NAME="sglang-scheduler")
    out = sim.ok(SGLANG_CONFIGURE_SUBPROCESS.format(), memory="2GiB", extra=extra, as_file=True)
    assert out["parent_preload"] == "", out
    assert out["child_preload"].endswith(UPSTREAM_PRELOAD), out
    assert out["child_libs"] == str(lib.resolve()), out
    assert int(out["child_freed"]) >= 16 * MIB, out
    assert out["child_same"] == "True", out
    assert out["child_exit"] == "0", out
    if which != "upstream":
        # One row, the scheduler (the launcher is not hooked), with its tag resident.
        assert out["ctl_rc"] == "0", out
        rows = [r.split() for r in out["ctl_list"].split("|") if "sglang-scheduler" in r]
        assert len(rows) == 1 and "weights" in rows[0], out
