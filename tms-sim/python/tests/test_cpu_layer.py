"""Tests of tms_sim_torch, the CPU compute layer that runs torch's CUDA ops on the simulator.

The whole pytest process runs on the simulator (one torch import for every test); each test
computes something on the simulated CUDA device and compares it, exactly, with the same
computation on the CPU. Two tests start children (a `threading.Thread` is in-process; the child
process test runs `python -c` with the inherited environment, so it exercises sitecustomize).

Run (from the repository root, after `cargo build -p tms-sim`):

    eval "$(target/debug/tms-sim env --node tms-sim-torch-test)"
    /root/.cache/tms/torch-venv/bin/python -m pytest -q tms-sim/python/tests/test_cpu_layer.py

or, equivalently, with the simulator preloaded:

    D=$PWD/target/debug/tms-sim-lib
    LD_PRELOAD=$D/libcudart.so.13 LD_LIBRARY_PATH=$D TMS_SIM_NODE=tms-sim-torch-test \
      PYTHONPATH=$PWD/tms-sim/python /root/.cache/tms/torch-venv/bin/python -m pytest -q \
      tms-sim/python/tests/test_cpu_layer.py

Without the simulator (or without torch) every test is skipped.
"""

import ctypes
import faulthandler
import os
import subprocess
import sys
import textwrap
import threading

import pytest

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

torch = pytest.importorskip("torch")
import tms_sim_torch  # noqa: E402

if os.environ.get("TMS_SIM_TORCH_LAYER") == "0":
    pytest.skip("TMS_SIM_TORCH_LAYER=0: the layer is off", allow_module_level=True)
if not tms_sim_torch.on_simulator():
    pytest.skip(
        "not on the tms simulator (see this file's docstring for the command)", allow_module_level=True
    )
assert tms_sim_torch.install(), "TMS_SIM_TORCH_LAYER=0?"


def same(cuda, cpu, strides=True):
    """`cuda` (a result on the simulated device) equals `cpu` exactly: device, dtype, shape,
    strides and values (NaN where NaN)."""
    if isinstance(cpu, (tuple, list)):
        assert isinstance(cuda, (tuple, list)) and len(cuda) == len(cpu)
        for a, b in zip(cuda, cpu):
            same(a, b, strides)
        return
    if not isinstance(cpu, torch.Tensor):
        assert cuda == cpu or (cuda != cuda and cpu != cpu)
        return
    assert cuda.device.type == "cuda", cuda.device
    assert cuda.dtype == cpu.dtype
    assert cuda.shape == cpu.shape
    if strides:
        assert cuda.stride() == cpu.stride()
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def both(fn, *inputs):
    """fn on CPU inputs and on CUDA copies of them (same strides): (cuda result, cpu result)."""
    cpu_in = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    cuda_in = [x.to("cuda") if isinstance(x, torch.Tensor) else x for x in inputs]
    return fn(*cuda_in), fn(*cpu_in)


def test_layer_is_active():
    assert torch.cuda.is_available()
    assert tms_sim_torch.installed()
    assert tms_sim_torch.install()  # idempotent
    x = torch.ones(3, device="cuda")
    assert x.device.type == "cuda"
    assert x.sum().item() == 3.0


def test_factories_and_rng_under_a_seed():
    def run(device):
        torch.manual_seed(1234)
        out = [
            torch.full((3, 5), 2.5, device=device),
            torch.ones(4, 2, dtype=torch.int32, device=device),
            torch.zeros(7, device=device),
            torch.arange(0, 10, 3, device=device),
            torch.linspace(0, 1, 9, device=device),
            torch.eye(3, device=device),
            torch.randn(64, device=device),
            torch.rand(3, 4, device=device),
            torch.randint(0, 100, (20,), device=device),
            torch.randperm(30, device=device),
            torch.empty(50, device=device).normal_(2.0, 3.0),
            torch.empty(50, device=device).uniform_(-1, 1),
            torch.bernoulli(torch.full((40,), 0.3, device=device)),
            torch.multinomial(torch.tensor([0.1, 0.5, 0.4], device=device), 10, replacement=True),
            torch.nn.functional.dropout(torch.ones(100, device=device), 0.5),
            torch.randn(5, device=device, dtype=torch.float64),
        ]
        return out

    same(run("cuda"), run("cpu"))


def test_explicit_cuda_generator():
    g = torch.Generator(device="cuda").manual_seed(7)
    c = torch.Generator().manual_seed(7)
    a1 = torch.randn(10, device="cuda", generator=g)
    same(a1, torch.randn(10, generator=c))
    state = g.get_state()
    a2 = torch.rand(10, device="cuda", generator=g)
    same(a2, torch.rand(10, generator=c))
    g.set_state(state)  # back to after the first draw: the same numbers again
    same(torch.rand(10, device="cuda", generator=g), a2.cpu())
    g.manual_seed(7)
    same(torch.randn(10, device="cuda", generator=g), a1.cpu())
    with pytest.raises(RuntimeError):
        torch.randn(3, device="cuda", generator=torch.Generator())


def test_arithmetic():
    torch.manual_seed(0)
    a = torch.randn(6, 5)
    b = torch.randn(5)
    i = torch.randint(-20, 20, (6, 5))
    ops = [
        lambda a, b, i: a + b,
        lambda a, b, i: a - 2 * b,
        lambda a, b, i: a * b / 3,
        lambda a, b, i: a / b,
        lambda a, b, i: a.pow(2) + a.abs().sqrt(),
        lambda a, b, i: a.exp().log1p(),
        lambda a, b, i: torch.where(a > 0, a, b),
        lambda a, b, i: a.clamp(-0.5, 0.5),
        lambda a, b, i: i // 3 + i % 7,
        lambda a, b, i: i * 2.5,  # int tensor and float scalar: promotion
        lambda a, b, i: torch.remainder(i, 4),
        lambda a, b, i: (i & 6) | 1,
        lambda a, b, i: torch.sigmoid(a) * torch.tanh(b),
        lambda a, b, i: torch.nn.functional.gelu(a) + torch.nn.functional.silu(a),
        lambda a, b, i: torch.nn.functional.softmax(a, dim=1),
        lambda a, b, i: torch.nn.functional.log_softmax(a, dim=0),
        lambda a, b, i: torch.nn.functional.layer_norm(a, (5,)),
        lambda a, b, i: a.half() * b.half(),
        lambda a, b, i: a.to(torch.bfloat16) + 1,
        lambda a, b, i: torch.tensor(float("nan"), device=a.device) * a,
    ]
    for fn in ops:
        same(*both(fn, a, b, i))


def test_inplace_ops_on_strided_views():
    torch.manual_seed(0)
    base = torch.randn(6, 8)

    def fn(x):
        x[::2].add_(1)
        x.t()[1].mul_(3)
        x[:, 1:7:3].copy_(torch.ones(6, 2, device=x.device) * 7)
        x.diagonal().fill_(-1)
        x[2:5, 2:5].clamp_(min=0)
        v = x.view(48)[5:29:4]
        v.sub_(v.clone() * 2)
        x.t()[3:].mul_(x.t()[:5])  # in place with an overlapping-storage operand
        x[4].index_add_(0, torch.tensor([0, 2, 2], device=x.device), torch.full((3,), 10.0, device=x.device))
        torch.add(x[0], x[1], out=x[5])  # out= a strided row of the same storage
        return x

    same(*both(fn, base))


def test_out_variants_resize():
    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(4, 3)

    def fn(a, b):
        out = torch.empty(0, device=a.device)
        torch.mul(a, b, out=out)  # resized from nothing
        small = torch.empty(2, device=a.device)
        torch.add(a, b, out=small)  # grown: new memory
        big = torch.empty(40, device=a.device)
        torch.sub(a, b, out=big)  # shrunk within its storage
        vals = torch.empty(0, device=a.device)
        idx = torch.empty(0, dtype=torch.long, device=a.device)
        torch.max(a, 1, out=(vals, idx))
        return out, small, big, vals, idx

    with pytest.warns(UserWarning):  # torch warns that `big`/`small` were resized, as on a GPU
        cuda, cpu = both(fn, a, b)
    same(cuda, cpu)


def test_noncontiguous_copies_and_dtype_changes():
    torch.manual_seed(0)
    x = torch.randn(5, 7)

    def fn(x):
        out = [
            x.t().contiguous(),
            x[:, ::2].clone(),
            x.t().to(torch.float16),
            x.to(torch.int32),
            (x > 0).to(torch.float32),
            x.to(torch.float64).t(),
            x.expand(2, 5, 7).contiguous(),
            x.permute(1, 0).reshape(-1),
        ]
        y = torch.zeros(7, 10, device=x.device)
        y[:, ::2].copy_(x.t())  # strided destination on the device
        out.append(y)
        z = torch.zeros(7, 5, dtype=torch.float64, device=x.device)
        z.copy_(x.t())  # dtype change and transposed source
        out.append(z)
        return out

    same(*both(fn, x))
    # host <-> device with strides on either side
    d = x.cuda()
    torch.testing.assert_close(d.t().cpu(), x.t(), rtol=0, atol=0)
    torch.testing.assert_close(d[:, 1::3].cpu(), x[:, 1::3], rtol=0, atol=0)
    h = torch.zeros(10, 7)
    h[::2].copy_(d)
    torch.testing.assert_close(h[::2], x, rtol=0, atol=0)
    e = torch.zeros(7, 5, device="cuda")
    e.copy_(x.t())  # non-contiguous host source into a device tensor
    same(e, x.t().contiguous())
    pinned = x.pin_memory()
    f = torch.empty(5, 7, device="cuda")
    f.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    same(f, x)


def test_comparisons():
    torch.manual_seed(0)
    a = torch.randn(20)
    b = a.clone()
    b[::3] += 1
    for fn in [
        lambda a, b: a == b,
        lambda a, b: a < b,
        lambda a, b: a >= 0,
        lambda a, b: torch.isclose(a, b),
        lambda a, b: torch.maximum(a, b),
        lambda a, b: a.sort(),
        lambda a, b: a.topk(5),
        lambda a, b: a.argmax(),
    ]:
        same(*both(fn, a, b))
    ca, cb = a.cuda(), b.cuda()
    assert torch.equal(ca, ca.clone()) and not torch.equal(ca, cb)
    assert torch.allclose(ca, ca + 1e-9) and not torch.allclose(ca, cb)
    assert bool((ca == ca).all()) and not bool((ca == cb).all())


def test_reductions():
    torch.manual_seed(0)
    x = torch.randn(8, 9, 5)
    for fn in [
        lambda x: x.sum(),
        lambda x: x.sum(dim=(0, 2)),
        lambda x: x.mean(1, keepdim=True),
        lambda x: x.var(0),
        lambda x: x.std(dim=2, unbiased=False),
        lambda x: x.prod(1),
        lambda x: x.norm(),
        lambda x: x.cumsum(1),
        lambda x: torch.logsumexp(x, 2),
        lambda x: x.max(1),
        lambda x: x.amin((0, 1)),
        lambda x: (x > 0).any(0),
        lambda x: (x > -5).all(),
        lambda x: x.transpose(0, 2).sum(1),
        lambda x: x.to(torch.int64).sum(0),
    ]:
        same(*both(fn, x))


def test_matmul():
    torch.manual_seed(0)
    a, b = torch.randn(7, 11), torch.randn(11, 5)
    bias = torch.randn(5)
    batch = torch.randn(3, 4, 6)
    img, w = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    for fn in [
        lambda: A @ B,
        lambda: torch.addmm(BIAS, A, B),
        lambda: A.t().t() @ B,
        lambda: torch.bmm(BATCH, BATCH.transpose(1, 2)),
        lambda: torch.einsum("bij,bkj->bik", BATCH, BATCH),
        lambda: torch.nn.functional.linear(A, B.t(), BIAS),
        lambda: torch.nn.functional.conv2d(IMG, W, padding=1),
        lambda: (A.half() @ B.half()),
    ]:
        results = []
        for dev in ("cuda", "cpu"):
            A, B, BIAS, BATCH, IMG, W = (t.to(dev) for t in (a, b, bias, batch, img, w))
            fn.__globals__.update(A=A, B=B, BIAS=BIAS, BATCH=BATCH, IMG=IMG, W=W)
            results.append(fn())
        same(*results)


def test_indexing():
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    idx = torch.tensor([4, 0, 2, 2])

    def fn(x, idx):
        m = x > 0
        y = x.clone()
        y[m] = 0
        y[idx, 1] = torch.arange(4.0, device=x.device)
        z = x.clone()
        z.index_put_((idx,), torch.ones(5, device=x.device), accumulate=True)
        return [
            x[idx],
            x[:, idx[:2]],
            x[m],
            x[1:4, [0, 3]],
            x.index_select(1, idx[:3]),
            x.gather(1, idx[:3].expand(6, 3)),
            torch.zeros(6, 5, device=x.device).scatter_(0, idx.view(4, 1).expand(4, 5), x[:4]),
            m.nonzero(),
            x.masked_fill(m, -1.0),
            y,
            z,
            torch.unique(idx),
            x[..., None, 2],
        ]

    same(*both(fn, x, idx))


def _train(device, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(16, 8).to(device)
    y = torch.randint(0, 4, (16,)).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def test_linear_adamw_training_loop():
    cuda_losses, cuda_params = _train("cuda")
    cpu_losses, cpu_params = _train("cpu")
    assert cuda_losses == cpu_losses
    same(cuda_params, cpu_params)


def test_autograd_matches_cpu():
    torch.manual_seed(0)
    x0, w0 = torch.randn(5, 4), torch.randn(4, 3)

    def grads(dev):
        x = x0.to(dev).requires_grad_()
        w = w0.to(dev).requires_grad_()
        y = torch.tanh(x @ w).pow(2).sum(1).mean() + (x[:, ::2] * 3).sum()
        y.backward()
        return [y.detach(), x.grad, w.grad]

    same(grads("cuda"), grads("cpu"))


def test_printing():
    torch.manual_seed(0)
    for x in [
        torch.randn(3, 4),
        torch.tensor([1.5, float("nan"), float("inf"), -0.0]),
        torch.arange(2000.0).view(40, 50),  # summarized
        torch.tensor([True, False]),
        torch.randn(2, 2, dtype=torch.complex64),
    ]:
        text = str(x.cuda())
        expected = str(x)
        assert text.startswith(expected[:-1]) and "device='cuda:0'" in text, (text, expected)


def test_computation_in_a_thread():
    result = {}

    def work():
        try:
            torch.manual_seed(3)
            a = torch.randn(4, 6, device="cuda")
            result["value"] = (a.t() @ a).softmax(1).cpu()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    torch.manual_seed(3)
    a = torch.randn(4, 6)
    torch.testing.assert_close(result["value"], (a.t() @ a).softmax(1), rtol=0, atol=0)


def _child(code, extra_env=None, timeout=120):
    """Runs `code` in a child Python with this process's environment (so on the simulator, through
    sitecustomize) plus `extra_env`; requires exit 0 and returns the completed process."""
    env = dict(os.environ, **(extra_env or {}))
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if PYDIR not in paths:
        env["PYTHONPATH"] = os.pathsep.join([PYDIR] + paths)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


def test_computation_in_a_child_process():
    code = textwrap.dedent(
        """
        import torch, tms_sim_torch
        assert tms_sim_torch.installed(), "sitecustomize did not install the layer"
        torch.manual_seed(5)
        x = (torch.randn(3, 3, device="cuda") * 2).exp().sum(0)
        torch.manual_seed(5)
        y = (torch.randn(3, 3) * 2).exp().sum(0)
        assert torch.equal(x.cpu(), y), (x, y)
        print("child ok", x.device)
        """
    )
    r = _child(code)
    assert "child ok cuda:0" in r.stdout


def test_default_stream_pinned_copies_are_queued_and_kernels_wait_for_them():
    # A child process at 0.5 GB/s: 64 MiB take about 134 ms on the modelled bus. On a GPU a
    # pinned copy on stream 0 returns before its bytes land and the next kernel on the stream
    # reads them landed; a layer that computed at once would read the old bytes.
    code = textwrap.dedent(
        """
        import torch, tms_sim_torch
        assert tms_sim_torch.installed()
        n = 16 << 20
        x = torch.arange(n, dtype=torch.float32).pin_memory()
        stream = torch.cuda.current_stream()
        assert stream.cuda_stream == 0
        d = x.to("cuda", non_blocking=True)
        in_flight = not stream.query()
        y = d * 2 + 1
        kernel_ok = torch.equal(y.cpu(), x * 2 + 1)
        h = torch.zeros(n, dtype=torch.float32).pin_memory()
        h.copy_(y, non_blocking=True)
        back_in_flight = not stream.query()
        stream.synchronize()
        back_ok = torch.equal(h, x * 2 + 1)
        print("in_flight=%s kernel_ok=%s back_in_flight=%s back_ok=%s" % (in_flight, kernel_ok, back_in_flight, back_ok))
        """
    )
    r = _child(code, {"TMS_SIM_COPY_GBPS": "0.5"})
    assert "in_flight=True kernel_ok=True back_in_flight=True back_ok=True" in r.stdout, r.stdout


def test_wide_reductions_add_float_sums_in_float64():
    # A child process: the switch is read when the layer registers its kernels.
    code = textwrap.dedent(
        """
        import torch, tms_sim_torch
        from tms_sim_torch import _wide
        assert tms_sim_torch.installed() and _wide.enabled()
        torch.manual_seed(7)
        # More than one chunk, so the chunked path adds partial sums too.
        x = torch.rand(3, _wide.CHUNK // 2 + 11) + 101.1
        d = x.to("cuda")
        exact = lambda r: r.to(torch.float32)
        checks = [
            (d.sum(), exact(x.double().sum())),
            (d.mean(), exact(x.double().mean())),
            (d.sum(1), exact(x.double().sum(1))),
            (d.mean(dim=(0, 1), keepdim=True), exact(x.double().mean(dim=(0, 1), keepdim=True))),
            (d.t().mean(0), exact(x.double().t().mean(0))),
            (d.half().sum(dtype=torch.float32), exact(x.half().double().sum())),
        ]
        for got, want in checks:
            assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
            assert torch.equal(got.cpu(), want), (got, want)
        # The switch changes something: float32 sums on the CPU round on the way.
        assert not torch.equal(x.sum(1), checks[2][1]), "pick data where float32 sums differ"
        # Integers and float64 keep the CPU's kernels.
        i = torch.arange(10, device="cuda")
        assert i.sum().item() == 45 and i.sum().dtype == torch.int64
        assert torch.equal(d.double().sum().cpu(), x.double().sum())
        # The graph replays the wide kernel, as the op ran outside capture.
        g = torch.cuda.CUDAGraph()
        out = None
        with torch.cuda.graph(g):
            out = (torch.ones(1000, device="cuda") * d[0, :1000].sum()).mean()
        g.replay()
        assert torch.equal(out.cpu(), exact(x[0, :1000].double().sum())), out
        print("wide ok")
        """
    )
    r = _child(code, {"TMS_SIM_WIDE_REDUCTIONS": "1"}, timeout=300)
    assert "wide ok" in r.stdout


def test_allocations_stay_on_the_device():
    torch.cuda.synchronize()
    a = torch.randn(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    b = a * 2  # the result comes from torch's caching allocator
    assert torch.cuda.memory_allocated() - before == b.numel() * 4
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        c = a + 1
        d = a.t().contiguous()
    in_pool = {seg["address"] for seg in pool.snapshot()}
    assert in_pool, "the pool has no segment"
    for t in (c, d):
        assert any(seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"] for seg in pool.snapshot())
    same(c, a.cpu() + 1)
    del b, c, d
    torch.cuda.empty_cache()


def test_streams_and_events():
    torch.manual_seed(0)
    x = torch.randn(1000)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        d = x.pin_memory().to("cuda", non_blocking=True)  # queued on the stream's worker
        y = d * 3 + 1  # waits for the copy: the layer synchronizes the current stream
        ev = torch.cuda.Event()
        ev.record()
    torch.cuda.current_stream().wait_event(ev)
    same(y.sum(), (x * 3 + 1).sum())


def test_ops_the_layer_cannot_run_raise():
    x = torch.randn(2, 5, 4, device="cuda")
    lstm = torch.nn.LSTM(4, 3).cuda()  # CUDA-only fused cell kernel, no CPU version
    with pytest.raises(RuntimeError):
        lstm(x)
    a = torch.randn(4, 4, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        torch.ops.aten.mm.dtype(a, a, torch.float32)  # CUDA-only out_dtype matmul
    # and the layer keeps working afterwards (no sticky error)
    same(a.float().sum(), a.cpu().float().sum())


def test_memory_saver_pause_resume(tms_torch_mode):
    """Computing across tms pause/resume (torch mode of libtms_hook.so, if built): values survive
    through the CPU backup, and an op on paused memory raises instead of faulting."""
    tms = tms_torch_mode
    with tms.region("cpu-layer-test", enable_cpu_backup=True):
        w = torch.arange(1 << 18, dtype=torch.float32, device="cuda") * 3
    view = w[1::2]
    expected = (w * 2).sum().item()
    tms.pause("cpu-layer-test")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        w * 2
    tms.resume("cpu-layer-test")
    assert (w * 2).sum().item() == expected
    view.add_(1)
    same(w[:4], torch.tensor([0.0, 4.0, 6.0, 10.0]))


# --------------------------------------------------------------------------------------------
# Kernels are asynchronous to the host, as on a GPU.

_HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _runtime_fn(name, argtypes, lib=None):
    from tms_sim_torch import _layer

    fn = getattr(lib or _layer._rt, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@pytest.fixture
def queued():
    """The layer queues kernels on their streams for the test (`tms_sim_torch.set_async`)."""
    was = tms_sim_torch.set_async(True)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        tms_sim_torch.set_async(was)


class _Gate:
    """Holds `stream` until opened, as a long kernel would: a host function that waits for an
    event. A watchdog opens it after `watchdog` seconds, so a layer that blocks the caller on the
    held stream fails the test (`forced`) instead of hanging it."""

    def __init__(self, stream, watchdog=30.0):
        self.event = threading.Event()
        self.forced = False
        self._fn = _HostFn(lambda _: self.event.wait())  # kept alive until the stream ran it
        launch = _runtime_fn("cudaLaunchHostFunc", [ctypes.c_void_p, _HostFn, ctypes.c_void_p])
        assert launch(stream.cuda_stream, self._fn, None) == 0
        self._timer = threading.Timer(watchdog, self._force)
        self._timer.daemon = True
        self._timer.start()

    def _force(self):
        self.forced = True
        self.event.set()

    def open(self):
        self._timer.cancel()
        self.event.set()


def test_kernels_on_the_default_stream_do_not_block_the_host(queued):
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    assert stream.cuda_stream == 0
    gate = _Gate(stream)
    y = x * 2  # each returns at once: the stream computes them after the gate, in order
    y.add_(1)  # in place, on a result not computed yet
    z = (y + x).sum()  # reads both in the stream's order
    w = torch.empty(0, device="cuda")
    torch.mul(x, 3, out=w)  # out= resized at the call, written when the stream gets there
    h = y[::2].float().neg()  # a view of a queued result, a dtype copy, a new result
    still_held = not stream.query()
    gate.open()
    assert not gate.forced, "a PyTorch op blocked the host while the default stream was held"
    assert still_held, "the default stream ran ahead of the held host function"
    torch.cuda.synchronize()
    cx = torch.arange(6, dtype=torch.float32)
    same(y, cx * 2 + 1)
    same(z, (cx * 2 + 1 + cx).sum())
    same(w, cx * 3)
    same(h, (cx * 2 + 1)[::2].neg())


def test_a_freed_block_reused_while_a_queued_kernel_still_reads_it(queued):
    # The caching allocator hands a block freed on a stream to the next allocation on the same
    # stream at once, as on a GPU: stream order makes the reader run before the new writer.
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    gate = _Gate(torch.cuda.current_stream())
    t = x + 1
    u = t * 2  # reads t when the stream gets there
    t_ptr = t.data_ptr()
    del t
    v = torch.full_like(x, 100.0)  # t's block, written after u read it
    gate.open()
    assert not gate.forced
    torch.cuda.synchronize()
    assert v.data_ptr() == t_ptr, "the test needs the allocator to reuse the freed block"
    cx = torch.arange(1024, dtype=torch.float32)
    same(u, (cx + 1) * 2)
    same(v, torch.full_like(cx, 100.0))


def test_a_kernel_on_a_created_stream_waits_for_its_event(queued):
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    gate = _Gate(main)
    a = x + 1  # on the default stream, behind the gate
    ev = torch.cuda.Event()
    ev.record(main)
    with torch.cuda.stream(side):
        side.wait_event(ev)
        b = a * 10  # queued on `side`, after the event
        a.record_stream(side)
    held = (main.query(), side.query())
    gate.open()
    assert not gate.forced
    assert held == (False, False), held
    side.synchronize()
    same(b, (torch.arange(8, dtype=torch.float32) + 1) * 10)


def test_data_dependent_ops_compute_after_the_queued_kernels(queued):
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    gate = _Gate(torch.cuda.current_stream())
    y = x - 2  # queued: [-2, -1, 0, 1, 2, 3]
    threading.Timer(0.1, gate.open).start()  # opened while the caller waits in nonzero
    nz = y.nonzero()  # its result's size depends on the data: computed in the caller, after y
    assert not gate.forced
    cy = torch.arange(6, dtype=torch.float32) - 2
    same(nz, cy.nonzero())
    assert nz.flatten().tolist() == [0, 1, 3, 4, 5]
    same(y[y > 0], torch.tensor([1.0, 2.0, 3.0]))
    assert (y * 2).sum().item() == 6.0


def test_a_failing_queued_kernel_is_reported_at_the_next_synchronize(queued):
    x = torch.arange(3, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied"):
        x.reshape(3, 1) @ x.reshape(3, 1)  # a shape error is still raised at the call
    idx = torch.tensor([5], device="cuda")
    y = x.index_select(0, idx)  # its sizes are fine; the index is out of range when it runs
    assert y.shape == (1,)
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        torch.cuda.synchronize()  # the stream's error: 719, cudaErrorLaunchFailure
    with pytest.raises(RuntimeError, match="index out of range"):
        x + 1  # the next op raises the kernel's own error, once
    torch.cuda.synchronize()
    same(x + 1, torch.arange(3, dtype=torch.float32) + 1)


def test_a_synchronize_that_keeps_the_gil_does_not_deadlock(queued):
    # A C caller that blocks in a synchronize without releasing the GIL (ctypes.PyDLL keeps it,
    # as C++ code may) while the stream's next kernel needs the GIL to run its Python: the
    # simulator lets go of the GIL while it waits. faulthandler's watchdog (a C thread) ends the
    # run with a traceback rather than hanging it if it does not.
    from tms_sim_torch import _layer

    keeps_gil = ctypes.PyDLL(_layer._rt._name, mode=os.RTLD_NOLOAD)
    sync = _runtime_fn("cudaStreamSynchronize", [ctypes.c_void_p], keeps_gil)
    x = torch.arange(4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    gate = _Gate(torch.cuda.current_stream())
    y = x * 2 + 1
    threading.Timer(0.05, gate.open).start()  # runs once the GIL is free
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        assert sync(None) == 0
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not gate.forced
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_memory_saver_pause_waits_for_queued_kernels(tms_torch_mode, queued):
    # The hook's pause synchronizes before it backs up and unmaps: a kernel still queued on the
    # region's memory writes first, and its result survives pause and resume.
    tms = tms_torch_mode
    with tms.region("cpu-layer-queued", enable_cpu_backup=True):
        w = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    gate = _Gate(torch.cuda.current_stream())
    w.mul_(3)  # queued behind the gate
    threading.Timer(0.1, gate.open).start()  # opened while pause waits
    tms.pause("cpu-layer-queued")
    tms.resume("cpu-layer-queued")
    assert not gate.forced
    same(w, torch.full((1 << 16,), 3.0))


def test_remembered_result_layouts_follow_every_argument_that_shapes_them(queued):
    # Queuing runs an op's meta kernel once per layout of its operands and remembers the results'
    # layout (`_layouts`). A key that missed an argument would give a later call the layout of
    # an earlier one: every pair below differs in one thing that changes the result's layout.
    from tms_sim_torch import _layouts

    xi = torch.arange(12, device="cuda").reshape(3, 4)
    xf = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    img = torch.arange(16, dtype=torch.float32, device="cuda").reshape(1, 1, 4, 4)
    cxi, cxf, cimg = xi.cpu(), xf.cpu(), img.cpu()
    hits_before = _layouts.stats()[0]
    for _ in range(2):  # the second round reads what the first remembered
        same(xi + 1, cxi + 1)  # int64
        same(xi + 1.5, cxi + 1.5)  # a float scalar promotes: float32
        same(xi + True, cxi + True)
        same(xf * 2, cxf * 2)
        same(xf.t() * 2, cxf.t() * 2)  # same sizes and dtype, other strides
        same(xf[:2] * 2, cxf[:2] * 2)
        same(xf.sum(0), cxf.sum(0))  # an int's value shapes a reduction
        same(xf.sum(1), cxf.sum(1))
        same(torch.nn.functional.pad(xf, (1, 1)), torch.nn.functional.pad(cxf, (1, 1)))
        same(torch.nn.functional.pad(xf, (2, 0)), torch.nn.functional.pad(cxf, (2, 0)))
        up2 = torch.nn.functional.interpolate(img, scale_factor=2.0)  # a float's value shapes it
        up3 = torch.nn.functional.interpolate(img, scale_factor=3.0)
        same(up2, torch.nn.functional.interpolate(cimg, scale_factor=2.0))
        same(up3, torch.nn.functional.interpolate(cimg, scale_factor=3.0))
        y = xf.clone()
        assert y.add_(1) is y  # an in-place op returns its operand
        out = torch.empty(0, device="cuda")
        torch.mul(xf, 3, out=out)  # resized at every call: never remembered
        same(out, cxf * 3)
        same(xf, cxf)
        same(y, cxf + 1)
    torch.cuda.synchronize()
    assert _layouts.stats()[0] - hits_before >= 15, "the second round ran the meta kernels again"
