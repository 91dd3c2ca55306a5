"""CUDA graphs through tms_sim_torch: `torch.cuda.graph` capture records the ops the layer would
compute as host-function nodes; `graph.replay()` re-runs them on the memory the graph captured.
Each test compares replayed results, exactly, with the same computation on the CPU (or, where
torch's CUDA code takes another path than its CPU code, run eagerly on the simulated device).

Run (from the repository root, after `cargo build -p tms-sim`):

    eval "$(target/debug/tms-sim env --node tms-sim-graph-test)"
    OMP_NUM_THREADS=1 /root/.cache/tms/torch-venv/bin/python -m pytest -q tms-sim/python/tests/test_cuda_graphs.py

Without the simulator (or without torch) every test is skipped; the tests that need the
simulator's stream capture skip when it refuses to capture (an older libtms_sim.so).
"""

import ctypes
import gc
import os
import sys

import pytest

PYDIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

torch = pytest.importorskip("torch")
import tms_sim_torch  # noqa: E402

if os.environ.get("TMS_SIM_TORCH_LAYER") == "0":
    pytest.skip("TMS_SIM_TORCH_LAYER=0: the layer is off", allow_module_level=True)
if not tms_sim_torch.on_simulator():
    pytest.skip("not on the tms simulator (see this file's docstring for the command)", allow_module_level=True)
assert tms_sim_torch.install()

from tms_sim_torch import _graphs, _layer  # noqa: E402


def _capture_supported():
    lib = _layer._rt
    lib.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.cudaGraphDestroy.argtypes = [ctypes.c_void_p]
    s = torch.cuda.Stream()
    if lib.cudaStreamBeginCapture(s.cuda_stream, 2):  # relaxed
        return False
    g = ctypes.c_void_p()
    assert lib.cudaStreamEndCapture(s.cuda_stream, ctypes.byref(g)) == 0
    lib.cudaGraphDestroy(g)
    return True


needs_capture = pytest.mark.skipif(
    not _capture_supported(), reason="this libtms_sim.so does not support stream capture"
)


def same(cuda, cpu):
    assert cuda.device.type == "cuda"
    assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(autouse=True)
def _no_pending_error_and_no_garbage():
    yield
    err = _graphs.pending
    _graphs.pending = None
    _graphs._skip = False
    # Graphs, tensors and tracebacks of failed captures go now, not during a later test's op.
    gc.collect()
    torch.cuda.empty_cache()
    assert err is None, f"a graph node failed at replay: {err}"


def _warm_up(fn):
    """torch's recipe: run once on a side stream before capturing."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)


@needs_capture
def test_linear_relu_inplace_add_replays():
    torch.manual_seed(0)
    lin_cpu = torch.nn.Linear(16, 8)
    lin = torch.nn.Linear(16, 8).cuda()
    lin.load_state_dict(lin_cpu.state_dict())
    static_in = torch.zeros(4, 16, device="cuda")
    static_out = torch.zeros(4, 8, device="cuda")

    def step():
        static_out.add_(torch.relu(lin(static_in)))

    with torch.no_grad():
        _warm_up(step)
        static_out.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            step()
            hidden = lin(static_in)  # a result allocated in the graph's pool
    # Capture computed nothing (the in-place add was recorded, not applied).
    same(static_out, torch.zeros(4, 8))

    x1 = torch.randn(4, 16)
    static_in.copy_(x1)
    g.replay()
    with torch.no_grad():
        h1 = lin_cpu(x1)
        e1 = torch.relu(h1)
    same(static_out, e1)
    same(hidden, h1)
    g.replay()  # the captured in-place add is applied once per replay
    same(static_out, e1 + e1)

    x2 = torch.randn(4, 16)
    static_in.copy_(x2)
    static_out.zero_()
    g.replay()
    with torch.no_grad():
        same(static_out, torch.relu(lin_cpu(x2)))
        same(hidden, lin_cpu(x2))


@needs_capture
def test_views_out_variants_copies_and_many_ops():
    torch.manual_seed(1)
    a0 = torch.randn(6, 5)
    b0 = torch.randn(5, 7)
    a = a0.cuda()
    b = b0.cuda()
    out = torch.empty(0, device="cuda")  # out= resized during capture (memory from the pool)
    strided = torch.zeros(5, 12, device="cuda")

    def fn(a, b, out, strided):
        y = (a @ b).softmax(1)
        torch.mul(y, 2, out=out)
        strided[:, ::2].copy_(a.t())  # a strided device copy (computed by the layer)
        v, i = y.max(1)
        s = y[:, 1:4].sum(0, keepdim=True)
        c = a.to(torch.float64).cumsum(0)
        return [y, out, strided, v, i, s, c, torch.where(a > 0, a, a * 0 - 1)]

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = fn(a, b, out, strided)
    g.replay()
    same_all = fn(a0.clone(), b0.clone(), torch.empty(0), torch.zeros(5, 12))
    for r, e in zip(res, same_all):
        same(r, e)
    assert out.shape == (6, 7)
    # New inputs, same memory.
    a1, b1 = torch.randn(6, 5), torch.randn(5, 7)
    a.copy_(a1)
    b.copy_(b1)
    g.replay()
    for r, e in zip(res, fn(a1, b1, torch.empty(0), torch.zeros(5, 12))):
        same(r, e)


@needs_capture
def test_random_ops_draw_at_replay():
    static = torch.empty(100, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static.normal_()
        drop = torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
        r = torch.randn(10, device="cuda")
        u = torch.rand(5, device="cuda", generator=gen)

    def expected(cpu_gen):
        return [
            torch.empty(100).normal_(),
            torch.nn.functional.dropout(torch.ones(64), 0.5),
            torch.randn(10),
            torch.rand(5, generator=cpu_gen),
        ]

    cpu_gen = torch.Generator().manual_seed(11)
    torch.manual_seed(7)
    g.replay()
    torch.manual_seed(7)
    first = expected(cpu_gen)
    for t, e in zip([static, drop, r, u], first):
        same(t, e)
    # The next replay draws new numbers, continuing both generators.
    torch.manual_seed(8)
    g.replay()
    torch.manual_seed(8)
    second = expected(cpu_gen)
    for t, e in zip([static, drop, r, u], second):
        same(t, e)
    assert not torch.equal(first[3], second[3])


@needs_capture
def test_graph_memory_survives_allocation_churn_and_is_released():
    torch.manual_seed(2)
    x0 = torch.randn(256, 64)
    x = x0.cuda()
    gc.collect()
    nodes_before = _graphs.stats()[0]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        t = (x * 2).exp()  # intermediates freed during capture go back to the graph's pool
        u = t.sum(1)
        out = (u - x.mean(1)).relu()
    assert _graphs.stats()[0] > nodes_before
    g.replay()
    expect = ((x0 * 2).exp().sum(1) - x0.mean(1)).relu()
    same(out, expect)
    # Churn: allocations and frees outside the graph, cache released to the device, new memory.
    for _ in range(3):
        junk = [torch.full((n, 1000), 7.0, device="cuda") for n in (1, 300, 3000)]
        del junk
        torch.cuda.empty_cache()
    filler = torch.full((4 << 20,), 9.0, device="cuda")
    g.replay()
    same(out, expect)
    same(filler[:3], torch.full((3,), 9.0))
    # Dropping the graph releases its nodes (torch's destroy callback).
    del g, t, u, out
    gc.collect()
    assert _graphs.stats()[0] == nodes_before


@needs_capture
def test_reset_and_recapture():
    x = torch.arange(6.0, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 3
    g.replay()
    same(y, torch.arange(6.0) * 3)
    n = _graphs.stats()[0]
    g.reset()
    assert _graphs.stats()[0] < n
    with torch.cuda.graph(g):
        z = x + 1
    x.fill_(2.0)
    g.replay()
    same(z, torch.full((6,), 3.0))


@needs_capture
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_ops_that_need_the_data_raise_during_capture():
    x = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    for fn in (lambda: x.nonzero(), lambda: x[x > 0], lambda: torch.unique(x), lambda: x.sum().item()):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(g):
                fn()
        del g
    # and the layer computes normally afterwards
    same(x.nonzero(), torch.tensor([[1], [2]]))


@needs_capture
def test_capturing_the_default_stream_is_refused():
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError):
        g.capture_begin()  # the current stream is the legacy default stream
    del g


@needs_capture
def test_replay_on_paused_memory_reports_at_the_next_op():
    """A node whose operand is not mapped (as the memory saver's pause leaves it) is skipped and
    its error raised by the next computed op."""
    x = torch.ones(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    same(y, torch.full((8,), 2.0))
    saved = _layer._view
    calls = []

    def refuse(ptr, n):
        calls.append(ptr)
        raise _layer.LayerError("CUDA error 700 (an illegal memory access was encountered): test")

    x.fill_(5.0)
    torch.cuda.synchronize()  # a queued fill (TMS_SIM_TORCH_ASYNC=1) must not meet the patched view
    _layer._view = refuse
    try:
        g.replay()
    finally:
        _layer._view = saved
    assert calls and _graphs.pending is not None
    same(y, torch.full((8,), 2.0))  # the node was skipped (.cpu() is a copy, not a computed op)
    g.replay()  # the next replay runs its nodes again; the error stays pending
    same(y, torch.full((8,), 10.0))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        x + 1
    assert _graphs.pending is None
    same(x + 1, torch.full((8,), 6.0))


@needs_capture
def test_memory_saver_pause_resume_between_replays(tms_torch_mode):
    """torch_memory_saver's flow with libtms_hook.so (torch mode, if built): a graph reading a
    region's tensor replays correctly after pause/resume and a refill; a replay while the region
    is paused reports the illegal access at the next op instead of faulting."""
    tms = tms_torch_mode
    with tms.region("graph-test-kv"):
        # 4 MiB: a segment of the caching allocator's large pool, of this tag's own pool.
        kv = torch.full((1 << 20,), 1.0, device="cuda")
    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = (x + kv.mean()) * 2
    x.fill_(100.0)
    g.replay()
    same(out, torch.full((4,), 202.0))
    tms.pause("graph-test-kv")
    g.replay()
    assert _graphs.pending is not None
    with pytest.raises(RuntimeError, match="illegal memory access"):
        x + 1
    tms.resume("graph-test-kv")
    kv.fill_(2.0)
    x.fill_(200.0)
    g.replay()
    same(out, torch.full((4,), 404.0))
    del g, kv, out


@needs_capture
def test_training_step_graph_matches_eager():
    """Forward, backward (in autograd's device thread) and a capturable AdamW step, captured
    whole: replays give exactly the losses and parameters of the same steps run eagerly."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, capturable=True)
        return model, opt

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(1)
    xs = [torch.randn(16, 8) for _ in range(4)]
    ys = [torch.randint(0, 4, (16,)) for _ in range(4)]
    model, opt = build()
    eager = [step(model, opt, x.cuda(), y.cuda()).item() for x, y in zip(xs, ys)]
    eager_params = [p.detach().cpu() for p in model.parameters()]

    model, opt = build()
    sx = xs[0].cuda()
    sy = ys[0].cuda()
    losses = []
    _warm_up(lambda: losses.append(step(model, opt, sx, sy).item()))  # the first step
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sloss = step(model, opt, sx, sy)
    for x, y in zip(xs[1:], ys[1:]):
        sx.copy_(x)
        sy.copy_(y)
        g.replay()
        losses.append(sloss.item())
    assert losses == eager
    for p, e in zip(model.parameters(), eager_params):
        same(p.detach(), e)


@needs_capture
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream")  # torch's, as on a GPU
def test_make_graphed_callables_matches_eager():
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()

    torch.manual_seed(1)
    xs = [torch.randn(4, 8, device="cuda") for _ in range(3)]
    model = build()
    eager = []
    for x in xs:
        y = model(x).pow(2).sum()
        y.backward()
        eager.append((y.item(), [p.grad.cpu() for p in model.parameters()]))
        model.zero_grad()
    model = build()
    graphed = torch.cuda.make_graphed_callables(model, (torch.randn(4, 8, device="cuda"),))
    model.zero_grad()
    for x, (loss, grads) in zip(xs, eager):
        y = graphed(x).pow(2).sum()
        y.backward()
        assert y.item() == loss
        for p, e in zip(model.parameters(), grads):
            same(p.grad, e)
        model.zero_grad()


@needs_capture
def test_capture_across_two_streams():
    """A stream that waits on the capturing stream joins the capture; its ops are recorded too."""
    x = torch.arange(8.0, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cur = torch.cuda.current_stream()
        y = x * 2
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            z = y + 1
        cur.wait_stream(side)
        w = z * y
    x.copy_(torch.full((8,), 3.0))
    g.replay()
    same(w, torch.full((8,), 42.0))


def test_capture_logic_with_a_fake_runtime():
    """The capture path without the simulator's stream capture: a fake runtime says the side
    stream captures and collects the host functions, which the test then runs as a replay."""

    class Fake:
        def __init__(self, real):
            self.real = real
            self.streams = set()
            self.keys = []

        def capturing(self, s):
            return s in self.streams

        def capture(self, s):
            return (-1, 0) if s in self.streams else None

        def host_func(self, s, key):
            self.keys.append(key)
            return 0

        def tie(self, graph, key):
            return False

    torch.manual_seed(3)
    w0 = torch.randn(5, 3)
    x0 = torch.randn(4, 5)
    w, x = w0.cuda(), x0.cuda()
    acc = torch.zeros(4, 3, device="cuda")
    real = _graphs.runtime
    fake = _graphs.runtime = Fake(real)
    s = torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            fake.streams.add(s.cuda_stream)
            y = torch.tanh(x @ w)
            acc.add_(y)
            fake.streams.discard(s.cuda_stream)
    finally:
        _graphs.runtime = real
    assert len(fake.keys) == 3  # mm, tanh, add_
    same(acc, torch.zeros(4, 3))  # nothing computed yet
    for _ in range(2):
        for k in fake.keys:
            _graphs._host_entry(k)
    e = torch.tanh(x0 @ w0)
    same(y, e)
    same(acc, e + e)
    _graphs._release(_graphs._captures[-1].key)
    assert all(k not in _graphs._nodes for k in fake.keys)
