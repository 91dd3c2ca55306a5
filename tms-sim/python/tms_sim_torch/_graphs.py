"""CUDA graphs through the CPU compute layer: capture records each computed op as a host node,
replay re-runs it on the memory the graph captured.

On a GPU nothing runs while a stream captures: kernels become graph nodes, and `graph.replay()`
runs them again on the addresses they captured. The simulator records the work submitted to a
capturing stream (async copies, memsets, host functions) as graph nodes and runs them, in order
and in the calling thread, at `cudaGraphLaunch`. The layer's CUDA kernels compute on the CPU, so
while the op's stream (the current stream of its device) captures, a kernel does not compute:

    1. it determines the op's results without computing: the op runs on "meta" tensors mirroring
       the CUDA operands (same sizes, strides, offsets, dtypes; operands sharing a storage share a
       meta storage), which gives the results' sizes, strides and dtypes, which results are
       operands (in-place and out= ops) or views of them, and how out= tensors are resized (an op
       without a meta kernel, whose results' sizes do not depend on the data, runs on zero-filled
       CPU stand-ins instead; an op the layer runs through a Python decomposition is captured op
       by op);
    2. out= tensors are resized the way the op would resize them (new memory, as `resize_` gives
       on a GPU, comes from the graph's pool) and new results are allocated from torch's CUDA
       caching allocator (during capture torch routes them to the graph's private pool);
    3. it queues a host function (`cudaLaunchHostFunc`) on the capturing stream, which becomes a
       graph node. At replay the node views the captured addresses as CPU tensors (aliases, as the
       layer always does) and runs the op's CPU kernel on them: in-place and out= ops write into
       their aliases, and new results are written into the memory captured for them (through the
       op's out= overload when it has one, else computed and copied).

The node keeps only addresses, sizes and strides (as a GPU kernel does), never a reference to a
tensor or its storage, so the caching allocator reuses memory within the capture and frees it as
on a GPU. Nodes live as long as the graph: for a `torch.cuda.CUDAGraph`, torch's capture-start hook
registers a destroy callback on the graph (fired by `reset()` or when the graph is collected) that
drops the capture's nodes; for a capture made otherwise, a CUDA user object retained by the graph
under construction does, where the runtime exposes that graph (the simulator does not yet), and
else the nodes live as long as the process.

Ops whose results cannot be known without the data (`nonzero`, `unique`, boolean-mask indexing,
`.item()`, ops returning Python numbers) raise during capture, as they do on a GPU (there they
synchronize). Random ops draw from the CPU generators at replay time (each replay draws new
numbers from the generator's state at that moment, like the graph-safe Philox offsets of a GPU).

A node that fails at replay (e.g. an operand whose memory is paused) cannot report through
`cudaGraphLaunch`: the error is printed, the replay's later nodes are skipped, and the next op the
layer computes raises it (a GPU reports a failed kernel at the next synchronizing call). The next
`torch.cuda.CUDAGraph.replay()` runs every node again.
"""

import atexit
import ctypes
import functools
import itertools
import re
import sys
import threading

import torch

from . import _layouts

_CPU = torch.device("cpu")
_META = torch.device("meta")
_Tensor = torch.Tensor
_STRIDED = torch.strided
_construct_storage = torch._C._construct_storage_from_data_pointer
_empty_cpu = torch.empty
_empty_strided = torch.empty_strided
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg

CAPTURE_STATUS_NONE = 0


class Capturing(Exception):
    """Raised inside the layer when the op's stream captures (caught by the kernel)."""

    def __init__(self, stream, device_index):
        super().__init__(stream, device_index)
        self.stream = stream
        self.device_index = device_index


class CaptureError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# The runtime calls capture needs (the simulator's; tests may install a fake as `runtime`).


_HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Runtime:
    def __init__(self, lib):
        self.is_capturing = lib.cudaStreamIsCapturing
        self.is_capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self.is_capturing.restype = ctypes.c_int
        # CUDA 13's seven-argument form.
        self.get_capture_info = lib.cudaStreamGetCaptureInfo
        self.get_capture_info.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.get_capture_info.restype = ctypes.c_int
        self.launch_host_func = lib.cudaLaunchHostFunc
        self.launch_host_func.argtypes = [ctypes.c_void_p, _HostFn, ctypes.c_void_p]
        self.launch_host_func.restype = ctypes.c_int
        self.host_func_error = lib.tms_sim_host_func_error
        self.host_func_error.argtypes = [ctypes.c_int]
        self.host_func_error.restype = ctypes.c_int
        self.user_object_create = getattr(lib, "cudaUserObjectCreate", None)
        self.retain_user_object = getattr(lib, "cudaGraphRetainUserObject", None)
        if self.user_object_create is not None and self.retain_user_object is not None:
            self.user_object_create.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                _HostFn,
                ctypes.c_uint,
                ctypes.c_uint,
            ]
            self.user_object_create.restype = ctypes.c_int
            self.retain_user_object.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            self.retain_user_object.restype = ctypes.c_int

    def capturing(self, stream):
        """Whether `stream` (a raw handle) is capturing (an invalidated capture counts: work on it
        is refused, not run)."""
        status = ctypes.c_int(0)
        rc = self.is_capturing(stream, ctypes.byref(status))
        return rc == 0 and status.value != CAPTURE_STATUS_NONE

    def capture(self, stream):
        """(capture id, graph handle) of the capture `stream` takes part in, or None."""
        status = ctypes.c_int(0)
        cid = ctypes.c_ulonglong(0)
        graph = ctypes.c_void_p(0)
        rc = self.get_capture_info(
            stream, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph), None, None, None
        )
        if rc or status.value == CAPTURE_STATUS_NONE:
            return None
        return cid.value, graph.value

    def host_func(self, stream, key):
        return self.launch_host_func(stream, _host_entry_c, key)

    def tie(self, graph, key):
        """Attaches a user object to `graph` whose destructor calls `_release(key)`; False when
        the runtime cannot."""
        if self.user_object_create is None or not graph:
            return False
        obj = ctypes.c_void_p(0)
        # cudaUserObjectNoDestructorSync = 1; one reference, moved to the graph
        # (cudaGraphUserObjectMove = 1).
        if self.user_object_create(ctypes.byref(obj), key, _release_c, 1, 1):
            return False
        return self.retain_user_object(graph, obj, 1, 1) == 0


runtime = None


def init(lib):
    global runtime
    runtime = Runtime(lib)


# --------------------------------------------------------------------------------------------
# The registry of host nodes: key -> node, owned by a capture until the graph is destroyed.

_lock = threading.Lock()
_nodes = {}  # key -> _Node
_captures = {}  # capture id -> _Owner
_owners = {}  # owner key -> _Owner
_keys = itertools.count(1)
_closing = False
pending = None  # (exception, op name, what failed): a node failed; raised by the next op
_skip = False  # a node of the current replay failed: its later nodes do nothing


class _Owner:
    __slots__ = ("key", "capture", "nodes", "tied")

    def __init__(self, key, capture):
        self.key = key
        self.capture = capture
        self.nodes = []
        self.tied = False


def _owner(cid):
    """The owner of capture `cid`'s nodes, and whether it was made now (call with _lock held)."""
    owner = _captures.get(cid)
    if owner is not None:
        return owner, False
    owner = _captures[cid] = _Owner(next(_keys), cid)
    _owners[owner.key] = owner
    return owner, True


def _add_node(stream, node):
    """Registers `node` and queues it as a host function on `stream` (capturing: a graph node;
    else a one-shot node the stream runs once)."""
    info = None if node.once else runtime.capture(stream)
    cid, graph = info if info is not None else (None, None)
    with _lock:
        key = next(_keys)
        _nodes[key] = node
        owner, new_owner = _owner(cid) if cid is not None else (None, False)
        if owner is not None:
            owner.nodes.append(key)
    if new_owner and graph:
        # The runtime exposes the graph under construction: tie the nodes to its lifetime.
        owner.tied = runtime.tie(graph, owner.key)
    rc = runtime.host_func(stream, key)
    if rc:
        with _lock:
            _nodes.pop(key, None)
            if owner is not None and key in owner.nodes:
                owner.nodes.remove(key)
        when = "when the stream reaches it" if node.once else "at replay"
        raise CaptureError(
            f"CUDA error {rc}: the stream refused the host function that computes {node.name} {when} "
            "(tms_sim_torch)"
        )


def _release(key):
    """User-object destructor: the graph (and its executable graphs) are gone."""
    if _closing:
        return
    try:
        with _lock:
            owner = _owners.pop(key, None)
            if owner is None:
                return
            if _captures.get(owner.capture) is owner:
                del _captures[owner.capture]
            for k in owner.nodes:
                _nodes.pop(k, None)
    except BaseException:  # noqa: BLE001 - never unwind into the runtime
        pass


def _on_capture_start(graph):
    """torch's capture-start hook (every `torch.cuda.CUDAGraph` capture): the nodes of this capture
    are released by the graph's destroy callback (fired by `reset()` or when the graph object is
    collected)."""
    if runtime is None:
        return
    info = runtime.capture(torch.cuda.current_stream().cuda_stream)
    if info is None:
        return
    with _lock:
        owner, _ = _owner(info[0])
        if owner.tied:
            return
        owner.tied = True
    # The callback must not reference the graph (torch's rule): only the owner's key.
    graph.register_destroy_callback(functools.partial(_release, owner.key))


def _on_replay_start(graph):
    """torch's replay-start hook: a new replay runs all its nodes again (an earlier replay's
    failure stays pending until an op raises it)."""
    global _skip
    _skip = False


def install_torch_hooks():
    """Ties nodes to `torch.cuda.CUDAGraph` lifetimes (torch's global graph hooks, where this
    torch has them; else nodes live as long as the process)."""
    g = torch.cuda.graphs
    ok = False
    register = getattr(g, "register_graph_capture_start_hook", None)
    if register is not None and hasattr(torch.cuda.CUDAGraph, "register_destroy_callback"):
        register(_on_capture_start)
        ok = True
    register = getattr(g, "register_graph_replay_start_hook", None)
    if register is not None:
        register(_on_replay_start)
    return ok


def _host_entry(key):
    """The host function of every node (called by the runtime at replay, or by the stream a
    one-shot node was queued on)."""
    global pending, _skip
    node = _nodes.get(key)
    if node is not None and node.once:
        with _lock:
            _nodes.pop(key, None)
        if not _closing:
            _run_once(node)
        return
    if _closing or _skip:
        return
    if node is None:
        return
    try:
        node()
    except BaseException as e:  # noqa: BLE001 - never unwind into the runtime
        _skip = True
        if pending is None:
            pending = (e, node.name, "a CUDA graph replay")
        try:
            sys.stderr.write(
                f"tms_sim_torch: a CUDA graph node ({node.name}) failed at replay: {type(e).__name__}: {e}\n"
                "  (this replay's later nodes are skipped; the next op computed raises this error)\n"
            )
        except BaseException:  # noqa: BLE001
            pass


def _run_once(node):
    """Runs a one-shot node (a kernel queued on a stream outside capture). A failure is the
    stream's error at its next synchronize (as a failed kernel's is on a GPU) and the next op the
    layer computes raises the Python exception."""
    global pending
    try:
        node()
    except BaseException as e:  # noqa: BLE001 - never unwind into the runtime
        if pending is None:
            pending = (e, node.name, "a kernel queued on a stream")
        code = 700 if "CUDA error 700" in str(e) else LAUNCH_FAILURE
        try:
            runtime.host_func_error(code)
            sys.stderr.write(
                f"tms_sim_torch: a queued CUDA kernel ({node.name}) failed: {type(e).__name__}: {e}\n"
                f"  (the stream's next synchronize returns CUDA error {code}; the next op computed raises this "
                "error)\n"
            )
        except BaseException:  # noqa: BLE001
            pass


LAUNCH_FAILURE = 719  # cudaErrorLaunchFailure: a kernel failed while it ran


def raise_pending():
    """Raises (once) the error a graph node met at replay or a queued kernel met when it ran."""
    global pending, _skip
    p = pending
    if p is None:
        return
    pending = None
    _skip = False
    e, name, what = p
    raise RuntimeError(f"{what} failed in {name} (tms_sim_torch): {type(e).__name__}: {e}") from e


def stats():
    """(live host nodes, live captures) in the registry: for tests."""
    with _lock:
        return len(_nodes), len(_owners)


# The C entry points live for the whole process (the runtime may call them until it exits).
_host_entry_c = _HostFn(lambda p: _host_entry(p or 0))
_release_c = _HostFn(lambda p: _release(p or 0))


def _at_exit():
    global _closing
    _closing = True


atexit.register(_at_exit)


# --------------------------------------------------------------------------------------------
# Capture.


_Slot = _layouts.Slot


def _snap(t):
    st = t.untyped_storage()
    return (
        st.data_ptr(),
        st.nbytes(),
        t.storage_offset(),
        tuple(t.size()),
        tuple(t.stride()),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


def _storage_key(st):
    n = st.nbytes()
    return st.data_ptr() if n else ("empty", st._cdata)


# Ops whose results' sizes depend on the data: a GPU synchronizes for them (so they fail during
# capture); without a meta kernel they must not be sized by a run on zeros.
_DATA_DEPENDENT = re.compile(
    r"unique|masked_select|bincount|nonzero|^aten::equal|sparse|nested|jagged|_ctc_loss|quantiz|"
    r"repeat_interleave|_local_scalar_dense|histogram"
)


class _Mirrors:
    """Stand-in tensors for the CUDA operands (meta tensors, or zero-filled CPU tensors), sharing
    storages where the operands do."""

    def __init__(self, device):
        self.device = device
        self.storages = {}  # storage key -> (stand-in storage, CUDA tensor owning it)
        self.owner_slots = {}  # stand-in storage _cdata -> slot of the first operand with it
        self.tensors = {}  # id(stand-in) -> (stand-in, slot index)

    def tensor(self, t, index):
        st = t.untyped_storage()
        key = _storage_key(st)
        ent = self.storages.get(key)
        if ent is None:
            n = st.nbytes()
            if self.device is _META:
                ms = torch.UntypedStorage(n, device=_META)
            else:
                ms = torch.zeros(n, dtype=torch.uint8).untyped_storage()
            ent = self.storages[key] = (ms, t)
            self.owner_slots[ms._cdata] = index
        m = _empty_cpu(0, dtype=t.dtype, device=self.device).set_(ent[0], t.storage_offset(), t.size(), t.stride())
        if t.is_conj():
            _set_conj(m, True)
        if t.is_neg():
            _set_neg(m, True)
        self.tensors[id(m)] = (m, index)
        return m

    def cpu_tensor(self, t):
        if self.device is _META and t.dim():
            return _empty_strided(t.size(), t.stride(), dtype=t.dtype, device=_META)
        return t


def _fill(template, sub):
    """`template` (args list or kwargs dict) with each _Slot replaced by `sub(slot)`."""
    items = template.items() if isinstance(template, dict) else enumerate(template)
    out = {} if isinstance(template, dict) else [None] * len(template)
    for k, v in items:
        if isinstance(v, _Slot):
            v = sub(v)
        elif isinstance(v, list) and any(isinstance(x, _Slot) for x in v):
            v = [sub(x) if isinstance(x, _Slot) else x for x in v]
        out[k] = v
    return out


def _qualname(op):
    s = op._schema
    return s.name + ("." + s.overload_name if s.overload_name else "")


def _returns_numbers(op):
    for r in op._schema.returns:
        t = str(r.type)
        if t not in ("Tensor", "List[Tensor]", "Optional[Tensor]"):
            return True
    return False


_no_meta_cache = {}


def _has_meta(name):
    v = _no_meta_cache.get(name)
    if v is None:
        import torch._meta_registrations  # noqa: F401 - the Python meta kernels, registered once

        has = torch._C._dispatch_has_kernel_for_dispatch_key
        v = _no_meta_cache[name] = any(
            has(name, k) for k in ("Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
        )
    return v


_out_cache = {}


def _out_variant(op):
    """(out= overload, names of its out arguments) computing functional `op` into given tensors,
    or None."""
    try:
        return _out_cache[op]
    except KeyError:
        pass
    found = None
    schema = op._schema
    rets = schema.returns
    if (
        rets
        and all(str(r.type) == "Tensor" for r in rets)
        and not any(a.alias_info is not None for a in schema.arguments)
    ):
        packet = op.overloadpacket
        for name in packet.overloads():
            cand = getattr(packet, name)
            cs = cand._schema
            outs = [a for a in cs.arguments if a.is_out]
            ins = [a for a in cs.arguments if not a.is_out]
            if len(outs) != len(rets) or len(ins) != len(schema.arguments):
                continue
            if any(str(a.type) != "Tensor" or not a.kwarg_only for a in outs):
                continue
            if all(
                a.name == b.name
                and str(a.type) == str(b.type)
                and a.kwarg_only == b.kwarg_only
                and a.default_value == b.default_value
                for a, b in zip(ins, schema.arguments)
            ) and torch._C._dispatch_has_computed_kernel_for_dispatch_key(_qualname(cand), "CPU"):
                found = (cand, tuple(a.name for a in outs))
                break
    _out_cache[op] = found
    return found


class _Node:
    """One captured op: re-run at each replay on CPU aliases of the captured memory."""

    __slots__ = ("name", "fn", "out_op", "args", "kwargs", "gen", "snaps", "sizes", "outputs", "once")

    def __call__(self):
        from . import _layer

        try:
            self._replay()
        finally:
            for ptr, n in self.sizes.items():
                _layer._end_view(ptr, n)

    def _replay(self):
        from . import _layer

        storages = {}
        for ptr, n in self.sizes.items():
            storages[ptr] = _construct_storage(_layer._view(ptr, n), _CPU, n)

        def alias(snap):
            ptr, _, off, size, stride, dtype, conj, neg = snap
            a = _empty_cpu(0, dtype=dtype).set_(storages[ptr], off, size, stride)
            if conj:
                _set_conj(a, True)
            if neg:
                _set_neg(a, True)
            return a

        aliases = [alias(s) for s in self.snaps]
        sub = lambda s: aliases[s.index]  # noqa: E731
        args = _fill(self.args, sub)
        kwargs = _fill(self.kwargs, sub)
        gen_slot = None
        if self.gen is not None:
            where, key, g = self.gen
            gen_slot = (args if where == "a" else kwargs, key, g)
        outs = self.outputs
        if outs and self.out_op is not None:
            op, names = self.out_op
            dsts = [alias(snap) for _, snap in outs]
            kw = dict(kwargs)
            kw.update(zip(names, dsts))
            try:
                _layer._run(op, args, kw, gen_slot)
                return
            except Exception:  # noqa: BLE001 - the functional op below raises what matters
                pass
        result = _layer._run(self.fn, args, kwargs, gen_slot)
        for path, snap in outs:
            r = result
            for i in path:
                r = r[i]
            dst = alias(snap)
            if dst.size() != r.size():
                raise CaptureError(
                    f"{self.name} gave a result of size {tuple(r.size())} at replay where capture "
                    f"predicted {tuple(dst.size())}"
                )
            dst.copy_(r)


def capture(op, spec, fn, args, kwargs, stop, once=False):
    """The CUDA kernel of `op` while its stream captures (`stop`: the `Capturing` raised): records
    a host node computing it at replay and returns the results' CUDA tensors (not yet computed).
    With `once`, outside capture: the node is queued on `stop.stream` and runs once, when the
    stream reaches it (the layer's asynchronous kernels)."""
    from . import _layer

    name = str(op)
    qual = _qualname(op)
    if _returns_numbers(op):
        raise CaptureError(
            f"CUDA error: operation not permitted when stream is capturing: {name} returns a value to "
            "the host, which would need the stream to synchronize (tms_sim_torch)"
        )
    numbers_ok = torch._C._should_allow_numbers_as_tensors(op._schema.name.split("::")[-1])
    device = torch.device("cuda", stop.device_index)

    # The template: CUDA tensors become slots, devices the CPU, CPU tensors are copied now (a GPU
    # bakes host values into the graph at capture).
    targs = list(args)
    tkwargs = dict(kwargs) if kwargs else {}
    operands = []  # CUDA tensors, by slot index
    slot_of = {}
    gen = None
    written = []  # (where, key, is_out)
    devices = []  # (where, key) of device arguments that were CUDA

    def slot(t):
        i = slot_of.get(id(t))
        if i is None:
            if t.device != device:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{device} and {t.device}! (tms_sim_torch: {name})"
                )
            i = slot_of[id(t)] = len(operands)
            operands.append(t)
        return _Slot(i)

    def keep(v):
        if isinstance(v, _Tensor):
            if v.is_cuda:
                return slot(v)
            return v.clone() if v.layout is _STRIDED else v
        return v

    for i, aname, kind, kwonly, w, out in spec:
        if not kwonly and i < len(targs):
            where, store, key = "a", targs, i
        elif aname in tkwargs:
            where, store, key = "k", tkwargs, aname
        else:
            continue
        v = store[key]
        if kind == "T":
            if isinstance(v, _Tensor):
                store[key] = keep(v)
            elif v is not None and not numbers_ok:
                store[key] = _layer._number_tensor(v)
        elif kind == "L":
            store[key] = [keep(x) for x in v]
        elif kind == "D":
            if v is not None:
                d = torch.device(v) if not isinstance(v, torch.device) else v
                if d.type == "cuda":
                    store[key] = _CPU
                    devices.append((where, key))
        elif v is not None:
            if v.device.type != "cuda":
                raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{v.device.type}'")
            gen = (where, key, v)
        if w:
            written.append((where, key, out))

    # Results without computing: the op on stand-ins, or the plan an earlier run on the same
    # layouts gave (`_layouts`).
    snaps = [_snap(t) for t in operands]
    plan_key = _layouts.key(op, targs, tkwargs, snaps) if gen is None else None
    plan = _layouts.lookup(plan_key)
    if plan is None:
        mirrors, mres = _outputs(op, name, qual, targs, tkwargs, operands, gen, devices)
        resized = False
        for where, key, out in written:
            store = targs if where == "a" else tkwargs
            v = store[key]
            for s in v if isinstance(v, list) else (v,):
                if isinstance(s, _Slot):
                    resized |= _follow(operands[s.index], mirrors, s.index, out, name)
        try:
            plan = _layouts.plan_of(mres, mirrors.tensors, mirrors.owner_slots)
        except _layouts.NotStrided as e:
            raise CaptureError(f"{name} gives a {e} result, which tms_sim_torch cannot capture") from None
        if not resized:
            _layouts.remember(plan_key, plan)
        else:
            snaps = [_snap(t) for t in operands]
    outputs = []
    result = _layouts.materialize(plan, operands, device, lambda path, t: outputs.append((path, _snap(t))))

    node = _Node()
    node.name = name
    node.fn = fn
    node.out_op = _out_variant(op) if outputs and len(outputs) == len(op._schema.returns) and fn is op else None
    node.args = targs
    node.kwargs = tkwargs
    node.gen = gen
    node.snaps = snaps
    sizes = {}
    for s in node.snaps + [snap for _, snap in outputs]:
        ptr, n = s[0], s[1]
        if sizes.get(ptr, -1) < n:
            sizes[ptr] = n
    node.sizes = sizes
    node.outputs = outputs
    node.once = once
    _add_node(stop.stream, node)
    return result


def _outputs(op, name, qual, targs, tkwargs, operands, gen, devices):
    """Runs `op` on meta stand-ins of the operands (or, for ops without a meta kernel whose
    results' sizes do not depend on the data, on zero-filled CPU stand-ins): (mirrors, result)."""
    meta = _has_meta(qual)
    if not meta and _DATA_DEPENDENT.search(qual):
        raise CaptureError(
            f"CUDA error: operation not permitted when stream is capturing: the size of {name}'s result "
            "depends on the data (tms_sim_torch)"
        )
    dev = _META if meta else _CPU
    mirrors = _Mirrors(dev)
    stand = [None] * len(operands)

    def sub(s):
        m = stand[s.index]
        if m is None:
            m = stand[s.index] = mirrors.tensor(operands[s.index], s.index)
        return m

    def conv(template):
        out = _fill(template, sub)
        items = out.items() if isinstance(out, dict) else enumerate(out)
        for k, v in list(items):
            if isinstance(v, _Tensor) and not v.is_meta:
                out[k] = mirrors.cpu_tensor(v)
            elif isinstance(v, list):
                out[k] = [mirrors.cpu_tensor(x) if isinstance(x, _Tensor) and not x.is_meta else x for x in v]
        return out

    margs, mkwargs = conv(targs), conv(tkwargs)
    if gen is not None:
        where, key, _ = gen
        (margs if where == "a" else mkwargs)[key] = None if meta else torch.Generator()
    for where, key in devices:  # CUDA device arguments: CPU in the template, meta here
        (margs if where == "a" else mkwargs)[key] = dev
    try:
        if meta:
            res = op(*margs, **mkwargs)
        else:
            state = torch.random.get_rng_state()  # a run on zeros must not draw from the generator
            try:
                res = op(*margs, **mkwargs)
            finally:
                torch.random.set_rng_state(state)
    except NotImplementedError as e:
        raise CaptureError(
            f"CUDA error: operation not permitted when stream is capturing: tms_sim_torch cannot tell "
            f"{name}'s results without computing it ({e})"
        ) from e
    return mirrors, res


def _follow(t, mirrors, index, out, name):
    """Gives written CUDA operand `t` the sizes, strides and offset the op gave its stand-in (an
    out= tensor the op resizes), with memory as `resize_` gives it on a GPU (values are not
    kept: the op overwrites them at replay). Whether it changed `t`."""
    m = None
    for s, i in mirrors.tensors.values():
        if i == index:
            m = s
            break
    if m is None or (m.size() == t.size() and m.stride() == t.stride() and m.storage_offset() == t.storage_offset()):
        return False
    if not out:
        raise CaptureError(f"{name} resizes an in-place operand, which tms_sim_torch cannot capture")
    if not t.untyped_storage().nbytes():
        fresh = _empty_strided(m.size(), m.stride(), dtype=t.dtype, device=t.device)
        t.set_(fresh.untyped_storage(), 0, fresh.size(), fresh.stride())
        return True
    if m.is_contiguous() and m.storage_offset() == 0:
        if t.size() != m.size() or not t.is_contiguous() or t.storage_offset():
            t.resize_(0).resize_(m.size())
        return True
    need = m.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(m.size(), m.stride())) if m.numel() else 0
    st = t.untyped_storage()
    have = st.nbytes() // t.element_size()
    t.set_(st, 0, (have,), (1,))
    if need > have:
        t.resize_(need)
    t.as_strided_(m.size(), m.stride(), m.storage_offset())
    return True
