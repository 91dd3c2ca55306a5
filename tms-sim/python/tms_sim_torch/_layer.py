"""The CPU compute layer: CPU implementations of PyTorch's CUDA kernels for the simulated device.

The simulator's device memory is not host memory: the process cannot dereference a device address,
as on a GPU. The simulator keeps the bytes in a host *view* (`tms_sim_host_view`, contiguous where
the device memory is), so a CUDA tensor's bytes can still be viewed as a CPU tensor without
copying: the view's address, same dtype, sizes, strides and storage offset (an *alias*). Every aten operator with a CUDA kernel (and a CPU
implementation to run instead) gets a CUDA-key kernel registered through `torch.library`:

    1. synchronize the current stream of the operands' device (async copies queued on it land
       first, as they would before a kernel on a GPU; on the default stream, whose copies and
       collectives are queued too, `tms_sim_host_view` waits for them);
    2. replace every CUDA tensor argument by its alias (tensors sharing a storage share one alias
       storage, so in-place ops, out= variants and overlapping views behave as on the device);
    3. run the same operator on the aliases (it dispatches to the CPU kernel);
    4. map the results back: an alias becomes the CUDA tensor it stands for, a view of an alias a
       CUDA view of the same storage, and a new CPU tensor is copied into fresh memory from
       torch's CUDA caching allocator (same sizes, strides and dtype).

Allocation (`empty*`), views, `resize_`/`set_`, `_local_scalar_dense` (`.item()`), pinning and
host<->device or contiguous same-dtype copies keep their real CUDA kernels: they launch nothing and
stay on the simulated device, so the caching allocator, MemPools, streams and memory-saver hooks
see exactly what they see on a GPU. Random numbers come from CPU generators (see "Random numbers"
below). CUDA-only ops without a CPU kernel run a Python decomposition from torch._decomp where
there is one; the others keep their CUDA kernel, whose launch fails and raises.

While the op's stream captures a CUDA graph, nothing is computed: the kernel determines the
results' layout without computing, allocates them, and records the computation as a host-function
node that each `graph.replay()` runs on the captured memory (see `_graphs`).

Kernels are asynchronous to the host, as on a GPU: outside capture, an op whose results' layout its
meta kernel gives is handled the same way, with a one-shot host function (`cudaLaunchHostFunc`)
queued on the op's current stream (the default stream included): the call returns at once with
results allocated from the caching allocator, and the stream computes them in its order, after the
work queued before. What cannot be queued computes in the caller as in steps 1-4 above, after the
stream's queued work: ops whose results' sizes depend on the data (`nonzero`, `unique`, boolean
masks: a GPU synchronizes for them too), ops returning numbers, random ops (they draw from the CPU
generators in program order, see "Random numbers"), decompositions, ops without a meta kernel,
and operands the meta kernel refuses (their error is raised by the CPU kernel, at the call). A
queued kernel that fails makes the stream's next synchronize return 719 (cudaErrorLaunchFailure),
or 700 for memory unmapped meanwhile, and the next op the layer computes raises its Python error.
Queuing is on by default; `TMS_SIM_TORCH_ASYNC=0` or `set_async(False)` computes every op in the
caller instead (see docs/simulator.md for when that helps).
"""

import atexit
import collections
import ctypes
import os
import threading
import warnings

import torch
import torch._decomp

from . import _graphs, _wide

_CPU = torch.device("cpu")
_Tensor = torch.Tensor
_construct_storage = torch._C._construct_storage_from_data_pointer
_raw_stream = torch._C._cuda_getCurrentRawStream
_current_device = torch._C._cuda_getDevice
_empty_cpu = torch.empty
_empty_strided = torch.empty_strided
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg
_memmove = ctypes.memmove
_STRIDED = torch.strided
_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_ASYNC = os.environ.get("TMS_SIM_TORCH_ASYNC", "1") != "0"
_NOTE = "(raised by the CPU kernel that tms_sim_torch runs for this {} op on the simulated device)"

# Ops with a CUDA kernel that launch nothing on a GPU (allocation, metadata, host-side queries,
# plain copies): they keep their real CUDA kernel. View ops (returns alias an input without
# writing) and in-place view ops (`resize_`, `set_`) are kept by rule, see `_keep`.
KEEP = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::_efficientzerotensor",
        "aten::_local_scalar_dense",  # cudaMemcpy + sync
        "aten::is_pinned",
        "aten::_pin_memory",
        "aten::is_set_to",
        "aten::record_stream",
        "aten::_cudnn_init_dropout_state",
        "aten::_nested_view_from_buffer",
    }
)

# CompositeExplicitAutograd ops whose CUDA path picks CUDA-only kernels (cuDNN, depthwise): run
# the whole op on the CPU instead. `copy_` has its own kernel below.
EXTRA = ("aten::convolution", "aten::_convolution")


class LayerError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# The simulator's runtime, for stream synchronization and the range check.


def _runtime():
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "tms_sim_stats"):
            return lib
    return None


_rt = None
_stream_sync = None
_peek_error = None
_host_view = None
_host_view_end = None
_accessible = None


def _init_runtime(rt):
    global _rt, _stream_sync, _peek_error, _host_view, _host_view_end, _accessible
    _rt = rt
    _stream_sync = rt.cudaStreamSynchronize
    _stream_sync.argtypes = [ctypes.c_void_p]
    _stream_sync.restype = ctypes.c_int
    _peek_error = rt.cudaPeekAtLastError
    _peek_error.argtypes = []
    _peek_error.restype = ctypes.c_int
    _host_view = rt.tms_sim_host_view
    _host_view.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _host_view.restype = ctypes.c_void_p
    _host_view_end = rt.tms_sim_host_view_end
    _host_view_end.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _host_view_end.restype = ctypes.c_int
    _accessible = rt.tms_sim_range_accessible
    _accessible.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _accessible.restype = ctypes.c_int
    _graphs.init(rt)
    _graphs.install_torch_hooks()


def _sync(dev_index):
    s = _raw_stream(dev_index)
    if s <= 2:
        # The default stream (0, 1, 2): its queued copies, memsets and collectives land before
        # the op reads, as `tms_sim_host_view` waits for that queue. Their errors stay for the
        # program's own synchronize, as a kernel launch leaves them on a GPU, but a sticky fault
        # (700: the context is dead) fails the launch; peeking changes no error state.
        if _peek_error() == 700:
            raise RuntimeError("CUDA error 700 (an illegal memory access was encountered): the context "
                               "has a sticky fault; reported before a CPU-computed op on the default stream")
        return
    if _graphs.runtime.capturing(s):
        # Nothing computes while the stream captures: the kernel records the op instead.
        raise _graphs.Capturing(s, dev_index)
    rc = _stream_sync(s)
    if rc:
        raise RuntimeError(f"CUDA error {rc}: reported by the current stream before a CPU-computed op")


class Accel:
    """A device type whose kernels the layer computes: CUDA, or torch_npu's "npu" (PrivateUse1,
    see `_npu`). Kernels, aliases and results only differ in how a tensor on it is recognized,
    how its current stream is synchronized and which device is current; queuing on streams and
    graph capture are CUDA's only."""

    __slots__ = ("type", "key", "is_dev", "sync", "current", "queue", "note")

    def __init__(self, type, key, is_dev, sync, current, queue, name):
        self.type = type  # torch.device type
        self.key = key  # the dispatch key its kernels are registered for
        self.is_dev = is_dev  # tensor -> whether it is on this device type (a fast getter)
        self.sync = sync  # device index -> None, after the current stream's work is done
        self.current = current  # () -> the current device index
        self.queue = queue  # whether kernels may be queued on its streams
        self.note = _NOTE.format(name)


CUDA = Accel("cuda", "CUDA", _Tensor.is_cuda.__get__, _sync, torch.cuda.current_device, True, "CUDA")


def _view(ptr, nbytes):
    """Where the host reaches device range `[ptr, ptr + nbytes)`. Memory the memory saver has
    paused (or that was freed) raises cudaErrorIllegalAddress: one query per storage and op, and a
    query, not a touch (a copy from unmapped memory would be a sticky fault ending the context)."""
    if not nbytes:
        return ptr
    view = _host_view(ptr, nbytes)
    if not view:
        raise LayerError(
            f"CUDA error 700 (an illegal memory access was encountered): device memory at {ptr:#x} "
            f"({nbytes} bytes) is not mapped with access (paused by the memory saver, or freed); "
            "tms_sim_torch cannot compute on it"
        )
    return view


def _end_view(ptr, nbytes):
    """The op is done with device range `[ptr, ptr + nbytes)`: its pages leave the process's
    resident set, as device memory is not in a process's RSS on a GPU (see tms_sim.h)."""
    if nbytes:
        _host_view_end(ptr, nbytes)


# --------------------------------------------------------------------------------------------
# Aliases.


class _Call:
    """State of one op call: alias storages by device pointer, aliases by id."""

    __slots__ = ("storages", "by_view", "aliases", "device", "synced", "accel")

    def __init__(self, accel=CUDA):
        self.storages = {}  # device data_ptr -> (cpu storage, device untyped storage, device)
        self.by_view = {}  # host view address -> the same entries
        self.aliases = {}  # id(alias) -> (alias, original)
        self.device = None  # where new results go: the first device operand's device
        self.synced = ()  # device indices whose current stream was synchronized
        self.accel = accel

    def end(self):
        """Ends the use of every view this call took (after the op and the results' mapping)."""
        for ptr, ent in self.storages.items():
            _end_view(ptr, ent[0].nbytes())

    def alias(self, t):
        """The CPU tensor viewing CUDA tensor `t`'s memory (same sizes, strides, offset, dtype)."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        ent = self.storages.get(ptr)
        if ent is None:
            dev = t.device
            if self.device is None:
                self.device = dev
            if dev.index not in self.synced:
                self.accel.sync(dev.index)
                self.synced = self.synced + (dev.index,)
            n = st.nbytes()
            view = _view(ptr, n)
            ent = self.storages[ptr] = (_construct_storage(view, _CPU, n), st, dev)
            if n:
                self.by_view[view] = ent
        a = _empty_cpu(0, dtype=t.dtype).set_(ent[0], t.storage_offset(), t.size(), t.stride())
        if t.is_conj():
            _set_conj(a, True)
        if t.is_neg():
            _set_neg(a, True)
        self.aliases[id(a)] = (a, t)
        return a

    def back(self, r):
        """Maps a CPU result to what the CUDA kernel returns."""
        if isinstance(r, _Tensor):
            ent = self.aliases.get(id(r))
            if ent is not None and ent[0] is r:
                return ent[1]
            if not r.is_cpu:
                return r
            if r.layout is not _STRIDED:
                return r.to(self._device())  # sparse results: torch's own conversion
            if self.by_view:
                st = r.untyped_storage()
                src = self.by_view.get(st.data_ptr())
                if src is not None and st.nbytes() and st.nbytes() <= src[0].nbytes():
                    # A view of an operand: the same view of the device storage.
                    v = _empty_strided((0,), (1,), dtype=r.dtype, device=src[2])
                    v = v.set_(src[1], r.storage_offset(), r.size(), r.stride())
                    if r.is_conj():
                        _set_conj(v, True)
                    if r.is_neg():
                        _set_neg(v, True)
                    return v
            return self.new(r)
        if isinstance(r, (tuple, list)):
            return type(r)(self.back(x) for x in r)
        return r

    def _device(self):
        if self.device is None:
            self.device = torch.device(self.accel.type, self.accel.current())
        return self.device

    def new(self, r):
        """A CUDA tensor from the caching allocator holding a copy of CPU tensor `r`."""
        if r.is_conj() or r.is_neg():
            r = r.resolve_conj().resolve_neg()
        dev = self.device
        if dev is None:
            dev = self._device()
        # Same sizes and strides: the bytes from r's first element on are the device layout (an
        # empty_strided storage is exactly the span the strides reach, gaps and overlaps included).
        out = _empty_strided(r.size(), r.stride(), dtype=r.dtype, device=dev)
        n = out.untyped_storage().nbytes()
        if n and r.numel():
            _memmove(_view(out.data_ptr(), n), r.data_ptr(), n)
            _end_view(out.data_ptr(), n)
        return out


# --------------------------------------------------------------------------------------------
# Random numbers.
#
# The choice: CUDA random ops draw from CPU generators, so a seeded program gives on the simulated
# device exactly the numbers it gives on the CPU.
# - The default CUDA generator is the CPU default generator: an op that would draw from
#   `torch.cuda.default_generators[i]` draws from `torch.default_generator`. `torch.manual_seed`
#   seeds it; `torch.cuda.manual_seed*` and `torch.cuda.{get,set}_rng_state` do not affect the
#   numbers (`torch.utils.checkpoint` and `torch.random.fork_rng` save and restore the CPU state
#   too, so recomputation sees the same masks).
# - An explicit CUDA generator (`torch.Generator("cuda")`) draws from a CPU generator seeded with
#   its seed, so it gives the numbers a CPU generator with that seed gives. After each draw its
#   Philox offset advances by 4, and the CPU generator's state is remembered under the CUDA
#   generator's new (seed, offset): the next draw, or one after `set_state` back to a state read
#   after one of the last 256 draws of any explicit generator, continues from there. A (seed,
#   offset) never reached this way (offset 0 is the seed's start) seeds the CPU generator from
#   both, deterministically. As with Philox, two generators at the same (seed, offset) give the
#   same numbers.


class _ExplicitRng:
    def __init__(self):
        self.gen = torch.Generator(device="cpu")
        self.states = collections.OrderedDict()  # (seed, offset) -> CPU generator state
        self.lock = threading.Lock()

    def enter(self, g):
        key = (g.initial_seed(), g.get_offset())
        state = self.states.get(key)
        if state is not None:
            self.gen.set_state(state)
        elif key[1] == 0:
            self.gen.manual_seed(key[0])
        else:
            self.gen.manual_seed((key[0] * 0x9E3779B97F4A7C15 + key[1]) & 0xFFFFFFFFFFFFFFFF)
        return key

    def leave(self, g, key):
        key = (key[0], key[1] + 4)
        g.set_offset(key[1])
        self.states[key] = self.gen.get_state()
        self.states.move_to_end(key)
        while len(self.states) > 256:
            self.states.popitem(last=False)


_explicit_rng = _ExplicitRng()


# --------------------------------------------------------------------------------------------
# Kernels.


def _spec(op):
    """Where an op's tensors, generators and devices are:
    (index, name, kind, keyword-only, written, out) per argument of interest."""
    spec = []
    for i, a in enumerate(op._schema.arguments):
        t = str(a.type)
        if t in ("Tensor", "Optional[Tensor]"):
            kind = "T"
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            kind = "L"
        elif t in ("Generator", "Optional[Generator]"):
            kind = "G"
        elif t in ("Device", "Optional[Device]"):
            kind = "D"
        else:
            continue
        written = a.alias_info is not None and a.alias_info.is_write
        spec.append((i, a.name, kind, a.kwarg_only, written, written and a.is_out))
    return tuple(spec)


def _number_tensor(v):
    """A C++ caller's wrapped number reaches a Python kernel as a Python number; the op (unless it
    is one of those that take numbers for tensors) needs a tensor. A 0-dim CPU tensor of the dtype
    a wrapped number promotes as; it differs from a wrapped number only next to another 0-dim
    tensor of the same category."""
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.get_default_dtype())
    if isinstance(v, complex):
        complex_dtype = torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64
        return torch.tensor(v, dtype=complex_dtype)
    return v


def _add_note(e, op, note=CUDA.note):
    try:
        e.add_note(f"{note}: {op}")
    except Exception:
        pass


def _resizable(call, t, keep_values):
    """A CPU tensor standing for written CUDA tensor `t` that the CPU op may resize (an alias's
    storage cannot grow): empty for an out= tensor, a copy for an in-place operand. After the op,
    `_propagate` gives `t` its sizes and values (on device memory from the caching allocator)."""
    if call.device is None:
        call.device = t.device
    if keep_values:
        tmp = call.alias(t).clone(memory_format=torch.preserve_format)
    else:
        if t.device.index not in call.synced:
            call.accel.sync(t.device.index)
            call.synced = call.synced + (t.device.index,)
        tmp = _empty_cpu(0, dtype=t.dtype)
    call.aliases[id(tmp)] = (tmp, t)
    return tmp


def _written_arg(call, t, out, resizable):
    if not isinstance(t, _Tensor) or not call.accel.is_dev(t):
        return t
    if out and not t.untyped_storage().nbytes():
        return _resizable(call, t, False)
    if resizable:
        return _resizable(call, t, not out)
    return call.alias(t)


def _make_kernel(op, spec, impl=None, cpu=None, accel=CUDA):
    """The kernel of `op` for `accel`'s devices (CUDA by default): runs `impl` (a decomposition
    into other ops) or `cpu` (a CPU function with the op's signature) on CPU aliases of the device
    operands; by default `op` itself, which then dispatches to its CPU kernel."""
    fn = cpu if cpu is not None else (op if impl is None else impl)
    written = tuple(s for s in spec if s[4])
    has_written = any(s[4] for s in spec)
    numbers_ok = torch._C._should_allow_numbers_as_tensors(op._schema.name.split("::")[-1])
    # None: may be queued (its meta kernel is looked up at the first call); False: never.
    queueable = None if accel.queue and impl is None and cpu is None and _maybe_queueable(op, spec) else False
    is_dev, dev_type, sync, note = accel.is_dev, accel.type, accel.sync, accel.note

    def convert(call, args, kwargs, resizable=False):
        args = list(args)
        gen_slot = None
        for i, name, kind, kwonly, w, out in spec:
            if not kwonly and i < len(args):
                where, key = args, i
            elif name in kwargs:
                where, key = kwargs, name
            else:
                continue
            v = where[key]
            if kind == "T":
                if isinstance(v, _Tensor):
                    if is_dev(v):
                        if call.device is not None and v.device != call.device:
                            raise RuntimeError(
                                "Expected all tensors to be on the same device, but found at least two "
                                f"devices, {call.device} and {v.device}! (tms_sim_torch: {op})"
                            )
                        where[key] = _written_arg(call, v, out, resizable) if w else call.alias(v)
                elif v is not None and not numbers_ok:
                    where[key] = _number_tensor(v)
            elif kind == "L":
                if any(isinstance(x, _Tensor) and is_dev(x) for x in v):
                    if w:
                        where[key] = [_written_arg(call, x, out, resizable) for x in v]
                    else:
                        where[key] = [call.alias(x) if isinstance(x, _Tensor) and is_dev(x) else x for x in v]
            elif kind == "D":
                if v is not None:
                    d = torch.device(v) if not isinstance(v, torch.device) else v
                    if d.type == dev_type:
                        idx = d.index if d.index is not None else accel.current()
                        if call.device is None:
                            call.device = torch.device(dev_type, idx)
                        if idx not in call.synced:
                            sync(idx)
                            call.synced = call.synced + (idx,)
                        where[key] = _CPU
            elif v is not None:  # an explicit generator (None: the CPU default generator)
                gen_slot = (where, key, v)
        return args, gen_slot

    def kernel(*args, **kwargs):
        nonlocal queueable
        if _graphs.pending is not None:
            _graphs.raise_pending()
        if _ASYNC and queueable is not False:
            if queueable is None:
                queueable = _graphs._has_meta(_graphs._qualname(op))
            if queueable:
                r = _queue(op, spec, fn, args, kwargs)
                if r is not _SYNC:
                    return r
        call = _Call(accel)
        ckwargs = dict(kwargs) if kwargs else {}
        try:
            cargs, gen_slot = convert(call, args, ckwargs)
        except _graphs.Capturing as e:
            stop = e
        else:
            stop = None
        if stop is not None:  # the stream captures: record the op, compute at replay
            if impl is not None:
                return impl(*args, **kwargs)  # a decomposition: its ops are captured one by one
            try:
                return _graphs.capture(op, spec, fn, args, kwargs, stop)
            except _graphs.CaptureError:
                raise
            except Exception as e:
                _add_note(e, op, note)
                raise
        first = call
        try:
            try:
                try:
                    result = _run(fn, cargs, ckwargs, gen_slot, dev_type)
                except RuntimeError as e:
                    if not has_written or "not resizable" not in str(e):
                        raise
                    # A written tensor had to grow beyond its storage: compute into resizable CPU
                    # tensors and give the CUDA tensors new memory (as `resize_` does on a device).
                    call = _Call(accel)
                    ckwargs = dict(kwargs)
                    cargs, gen_slot = convert(call, args, ckwargs, resizable=True)
                    result = _run(fn, cargs, ckwargs, gen_slot, dev_type)
            except Exception as e:
                _add_note(e, op, note)
                raise
            for i, name, kind, kwonly, _, _ in written:
                _propagate(call, cargs[i] if (not kwonly and i < len(cargs)) else ckwargs.get(name))
            return call.back(result)
        finally:
            first.end()
            if call is not first:
                call.end()

    kernel.__name__ = f"tms_sim_cpu_{op.__name__}"
    return kernel


_SYNC = object()  # `_queue`: compute in the caller


def set_async(on):
    """Queues kernels on their streams (True, the default) or computes them in the caller
    (False); returns the previous setting. Work already queued stays queued."""
    global _ASYNC
    was, _ASYNC = _ASYNC, bool(on)
    if on and not was:
        _drain_at_exit_once()
    return was


class _Launch:
    """Where a queued kernel goes (what `_graphs.capture` reads of a `Capturing`)."""

    __slots__ = ("stream", "device_index")

    def __init__(self, stream, device_index):
        self.stream = stream
        self.device_index = device_index


def _maybe_queueable(op, spec):
    """Whether `op` may be queued, or always computes in the caller: ops returning numbers, random
    ops (their draws stay in program order) and ops whose results' sizes depend on the data."""
    if _graphs._returns_numbers(op) or any(s[2] == "G" for s in spec):
        return False
    if torch.Tag.nondeterministic_seeded in op.tags:
        return False
    return not _graphs._DATA_DEPENDENT.search(_graphs._qualname(op))


def _cuda_operands(spec, args, kwargs):
    """The CUDA tensors among an op's arguments, and the device a CUDA device argument names."""
    tensors = []
    device = None
    for i, name, kind, kwonly, _, _ in spec:
        if not kwonly and i < len(args):
            v = args[i]
        elif name in kwargs:
            v = kwargs[name]
        else:
            continue
        if kind == "T":
            if isinstance(v, _Tensor) and v.is_cuda:
                tensors.append(v)
        elif kind == "L":
            tensors.extend(x for x in v if isinstance(x, _Tensor) and x.is_cuda)
        elif kind == "D" and v is not None and device is None:
            d = torch.device(v) if not isinstance(v, torch.device) else v
            if d.type == "cuda":
                device = d.index if d.index is not None else torch.cuda.current_device()
    return tensors, device


def _queue(op, spec, fn, args, kwargs):
    """Queues `op` on its current stream (see the module's docstring): its results, or `_SYNC`
    when it must compute in the caller."""
    tensors, index = _cuda_operands(spec, args, kwargs)
    if tensors:
        index = tensors[0].device.index
    elif index is None:
        return _SYNC
    stream = _raw_stream(index)
    if _graphs.runtime.capturing(stream):
        return _SYNC  # recorded by the capture path
    for t in tensors:
        st = t.untyped_storage()
        n = st.nbytes()
        if n and _accessible(st.data_ptr(), n) != 1:
            return _SYNC  # paused or freed memory: the caller's path raises at the call
    try:
        if index == _current_device():
            return _graphs.capture(op, spec, fn, args, kwargs, _Launch(stream, index), once=True)
        # The default stream is per device, and the runtime queues on the calling thread's device:
        # torch sets no device guard around a Python kernel.
        with torch.cuda.device(index):
            return _graphs.capture(op, spec, fn, args, kwargs, _Launch(stream, index), once=True)
    except Exception:  # noqa: BLE001 - the caller's path computes it, or raises the op's own error
        return _SYNC


def _run(fn, args, kwargs, gen_slot, dev_type="cuda"):
    """fn(*args, **kwargs) on CPU aliases; an explicit device generator at gen_slot (where, key,
    generator) draws from its CPU stand-in (see "Random numbers")."""
    if gen_slot is not None:
        where, key, g = gen_slot
        if g.device.type != dev_type:
            raise RuntimeError(f"Expected a '{dev_type}' device type for generator but found '{g.device.type}'")
        rng = _explicit_rng
        with rng.lock:
            k = rng.enter(g)
            where[key] = rng.gen
            try:
                return fn(*args, **kwargs)
            finally:
                rng.leave(g, k)
    return fn(*args, **kwargs)


def _propagate(call, a):
    """A written argument after the op: when the CPU op resized or restrided its alias (CPU
    `resize_`/`as_strided_`/`set_` of an out= tensor), give the CUDA tensor the same sizes and
    strides, and when it gave the alias other memory, device memory holding the same values."""
    if isinstance(a, (list, tuple)):
        for x in a:
            _propagate(call, x)
        return
    if not isinstance(a, _Tensor):
        return
    ent = call.aliases.get(id(a))
    if ent is None:
        return
    t = ent[1]
    own = call.storages.get(t.untyped_storage().data_ptr())
    same_memory = own is not None and a.untyped_storage().data_ptr() == own[0].data_ptr()
    if same_memory and a.size() == t.size() and a.stride() == t.stride() and a.storage_offset() == t.storage_offset():
        return
    if same_memory:
        t.set_(t.untyped_storage(), a.storage_offset(), a.size(), a.stride())
    else:
        _adopt(call, t, a)


def _adopt(call, t, a):
    """Gives CUDA tensor `t` the sizes, strides, offset and values of CPU tensor `a`, growing its
    storage in place (the storage object stays, as with `resize_` on the device) when needed."""
    if not t.untyped_storage().nbytes():
        # The usual case (an out= tensor made by `empty(0)`): nothing to keep, new memory.
        fresh = call.new(a)
        t.set_(fresh.untyped_storage(), 0, fresh.size(), fresh.stride())
        return
    if a.is_contiguous() and a.storage_offset() == 0:
        if t.size() != a.size() or not t.is_contiguous() or t.storage_offset():
            t.resize_(0).resize_(a.size())
    else:
        need = a.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(a.size(), a.stride())) if a.numel() else 0
        st = t.untyped_storage()
        have = st.nbytes() // t.element_size()
        t.set_(st, 0, (have,), (1,))
        if need > have:
            t.resize_(need)
        t.as_strided_(a.size(), a.stride(), a.storage_offset())
    if a.numel():
        call.alias(t).copy_(a)


def _copy_kernel(dst, src, non_blocking=False):
    """`copy_`: host<->device copies and contiguous same-dtype device copies keep torch's own path
    (cudaMemcpy on the simulator; it comes back here for any part that needs a kernel), the rest
    (dtype conversion, strides, broadcasting) is a CPU copy between aliases."""
    if dst.is_cuda and src.is_cuda:
        if (
            dst.dtype == src.dtype
            and dst.device == src.device
            and dst.size() == src.size()
            and dst.is_contiguous()
            and src.is_contiguous()
            and dst.is_conj() == src.is_conj()
            and dst.is_neg() == src.is_neg()
        ):
            return _copy_op.redispatch(_CPU_KEYSET, dst, src, non_blocking)
        if _graphs.pending is not None:
            _graphs.raise_pending()
        if _ASYNC and _queue(_copy_op, _copy_spec, _copy_op, (dst, src, non_blocking), {}) is not _SYNC:
            return dst
        call = _Call()
        try:
            stop = None
            try:
                call.alias(dst).copy_(call.alias(src))
            except _graphs.Capturing as e:
                stop = e
            if stop is not None:  # the stream captures: record the copy, run it at replay
                _graphs.capture(_copy_op, _copy_spec, _copy_op, (dst, src, non_blocking), {}, stop)
        except _graphs.CaptureError:
            raise
        except Exception as e:
            _add_note(e, "aten.copy_.default")
            raise
        finally:
            call.end()
        return dst
    return _copy_op.redispatch(_CPU_KEYSET, dst, src, non_blocking)


_copy_op = torch.ops.aten.copy_.default
_copy_spec = _spec(_copy_op)


def _fused_sdp_choice_kernel(*args, **kwargs):
    # Fused attention kernels have no CPU implementation reachable from CUDA tensors: the math path.
    return int(torch._C._SDPBackend.MATH)


# --------------------------------------------------------------------------------------------
# Registration.


def _op_of(qualname):
    ns, rest = qualname.split("::", 1)
    name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")


def _keep(name, op, keep=KEEP):
    if name in keep:
        return True
    if torch.Tag.inplace_view in op.tags:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def plan():
    """(qualified name, op, impl) of every op this layer computes on the CPU: impl is None for the
    op's own CPU kernel, else a Python decomposition (for CUDA-only ops that have one)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    computed = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    decompositions = torch._decomp.decomposition_table
    ops = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::") or not has(name, "CUDA"):
            continue
        op = _op_of(name)
        if _keep(name, op):
            continue
        if computed(name, "CPU"):
            ops.append((name, op, None))
        elif op in decompositions:
            ops.append((name, op, decompositions[op]))
        # else nothing runs instead: the CUDA kernel stays (and raises if it launches one)
    for name in EXTRA:
        ops.append((name, _op_of(name), None))
    return ops


_lib = None


def _drain_at_exit():
    """Kernels still queued at exit run before the interpreter finalizes (they run Python; torch
    would otherwise lose their results only, but a host function entering a finalizing
    interpreter ends its thread). Runs before `_graphs`' exit handler (registered earlier)."""
    try:
        for i in range(torch.cuda.device_count()):
            try:
                torch.cuda.synchronize(i)
            except Exception:  # noqa: BLE001 - the program's errors were its own to check
                pass
    except Exception:  # noqa: BLE001
        pass


_drain_registered = False


def _drain_at_exit_once():
    """Kernels are queued from now on: drain them at exit, and let the simulator's waits release
    the GIL, which a queued kernel needs (a caller synchronizing with it held would wait forever)."""
    global _drain_registered
    if not _drain_registered:
        _drain_registered = True
        atexit.register(_drain_at_exit)
    if _rt is not None:
        _rt.tms_sim_python_on_streams()


def register():
    """Registers the CUDA kernels (once: see `install`); returns how many ops it covers."""
    global _lib
    rt = _runtime()
    if rt is None:
        raise LayerError("tms_sim_torch: the simulator's runtime (libtms_sim.so as libcudart) is not loaded")
    _init_runtime(rt)
    lib = torch.library.Library("aten", "IMPL")
    specials = {
        "aten::_fused_sdp_choice": _fused_sdp_choice_kernel,
    }
    wide = _wide.enabled()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        count = 0
        for name, op, impl in plan():
            count += 1
            short = name.split("::", 1)[1]
            fn = specials.get(name)
            if fn is None and wide and impl is None and name in _wide.OPS:
                fn = _make_kernel(op, _spec(op), cpu=_wide.make(op, name))
            if fn is None:
                fn = _make_kernel(op, _spec(op), impl)
            lib.impl(short, fn, "CUDA")
        lib.impl("copy_", _copy_kernel, "CUDA")
    _lib = lib
    if _ASYNC:
        _drain_at_exit_once()
    # cuDNN would be chosen for batch norm, RNNs, grid sampling and CTC loss on CUDA tensors; its
    # library cannot run on the simulator. Without it torch takes its native kernels, which this
    # layer computes on the CPU.
    torch.backends.cudnn.enabled = False
    # Likewise the fused attention kernels (flash, memory-efficient, cuDNN) have no CPU version
    # reachable from CUDA tensors: scaled_dot_product_attention takes its math path.
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        fn = getattr(torch.backends.cuda, name, None)
        if fn is not None:
            fn(False)
    return count + 1
