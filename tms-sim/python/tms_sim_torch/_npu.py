"""The CPU compute layer for torch_npu's "npu" device (PrivateUse1) on the simulated Ascend devices.

torch_npu computes every operator through CANN's operator compiler or the aclnn libraries, which
the simulator does not have (their calls fail with 207000). This module gives the PrivateUse1
dispatch key the same kernels `_layer` gives CUDA: every aten op that torch_npu (or CUDA) has a
kernel for and that has a CPU kernel runs on CPU aliases of the NPU operands' bytes (the
simulator's host view of device memory), its results written into memory from torch_npu's caching
allocator. Allocation (`empty*`, `empty_like`, `new_empty_strided`), views, `resize_`/`set_`,
`.item()`, pinning and plain copies (host<->device and device<->device, contiguous and of one
dtype: `aclrtMemcpy`) stay torch_npu's.

Differences from the CUDA layer:
- Kernels compute in the caller, after the op's device's current NPU stream (and torch_npu's task
  queue, which launches its copies) has run what was queued on it: no queuing on streams, no
  graph capture.
- torch_npu registers its own autograd kernels (AutogradPrivateUse1) for some aten ops, whose
  backward passes call NPU-only operators (`matmul_backward`, `npu_dropout_*`, ...). Those are
  given back torch's own: the op's composite decomposition where it has one, otherwise torch's
  autograd kernel (the one every other backend uses). Gradients then are those the CPU computes.
- Operators of torch_npu's own (`npu_*`, in the `aten` and `npu` namespaces) have no CPU kernel:
  they keep torch_npu's, whose launch fails with the operator's name.

`register()` runs once torch_npu has registered its kernels (they would replace these otherwise):
`tms_sim_torch.install()` calls it when torch_npu is loaded, and sitecustomize when it is imported
later.
"""

import ctypes
import warnings

import torch

from . import _layer

_K = torch._C.DispatchKey
_P1_KEYSET = torch._C.DispatchKeySet(_K.PrivateUse1)
# torch's autograd kernel of an op, reached without torch_npu's AutogradPrivateUse1 one: the
# Autograd alias kernel serves AutogradOther too, and redispatches below autograd with the same
# set, so ADInplaceOrView (where the op has a kernel there: version counters, views) and then the
# PrivateUse1 kernel run. An explicit set skips no fallthrough: only keys with kernels go in.
_AUTOGRAD_KEYSET = torch._C.DispatchKeySet(_K.AutogradOther) | _P1_KEYSET
_AUTOGRAD_INPLACE_KEYSET = _AUTOGRAD_KEYSET | torch._C.DispatchKeySet(_K.ADInplaceOrView)

# Allocation without a kernel on an NPU, besides `_layer.KEEP`.
KEEP = _layer.KEEP | frozenset({"aten::empty_like", "aten::new_empty_strided"})

_acl_sync = None
_memcpy_sync = None
_memcpy_async = None
_raw_stream = None
_lib = None


def _sync(dev_index):
    # torch_npu's current raw stream, after its task queue has launched what it holds.
    rc = _acl_sync(_raw_stream(dev_index))
    if rc:
        raise RuntimeError(f"ACL error {rc}: reported by the current NPU stream before a CPU-computed op")


def _is_npu(t):
    return t.device.type == "npu"


NPU = _layer.Accel("npu", "PrivateUse1", _is_npu, _sync, None, False, "NPU")


def _plain(dst, src):
    return (
        dst.dtype == src.dtype
        and dst.size() == src.size()
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.is_conj() == src.is_conj()
        and dst.is_neg() == src.is_neg()
    )


def _memcpy(dst, src):
    """A contiguous copy of one dtype through the runtime, as torch_npu makes it (its own kernel
    cannot be called once this one replaces it): device to device on the destination's current
    stream, to or from the host synchronously (the host memory may be reused at once)."""
    n = dst.numel() * dst.element_size()
    if not n:
        return
    d, s = _is_npu(dst), _is_npu(src)
    idx = (dst if d else src).device.index
    stream = _raw_stream(idx)
    if d and s:
        if src.device.index != idx:
            _sync(src.device.index)
        rc = _memcpy_async(dst.data_ptr(), n, src.data_ptr(), n, 3, stream)  # ACL_MEMCPY_DEVICE_TO_DEVICE
    else:
        rc = _acl_sync(stream) or _memcpy_sync(dst.data_ptr(), n, src.data_ptr(), n, 1 if d else 2)
    if rc:
        raise RuntimeError(f"ACL error {rc}: a copy between {src.device} and {dst.device} failed")


def _copy_kernel(dst, src, non_blocking=False):
    """`copy_` with an NPU side: a runtime copy for contiguous copies of one dtype, else (dtype
    conversion, strides, broadcasting) a CPU copy between aliases."""
    if _plain(dst, src):
        try:
            _memcpy(dst, src)
        except Exception as e:
            _layer._add_note(e, "aten.copy_.default", NPU.note)
            raise
        return dst
    call = _layer._Call(NPU)
    try:
        d = call.alias(dst) if _is_npu(dst) else dst
        d.copy_(call.alias(src) if _is_npu(src) else src)
    except Exception as e:
        _layer._add_note(e, "aten.copy_.default", NPU.note)
        raise
    finally:
        call.end()
    return dst


def _to_copy_kernel(*args, **kwargs):
    # torch's own `_to_copy` (allocate, then `copy_`), not torch_npu's (an NPU cast operator).
    return _to_copy_op.redispatch(_layer._CPU_KEYSET, *args, **kwargs)


def _lazy_clone_kernel(self):
    # A CPU lazy clone would share the alias's storage (copy on write), which the device cannot.
    return torch.ops.aten.clone.default(self)


_to_copy_op = torch.ops.aten._to_copy.default


def _autograd_kernel(op):
    """torch's autograd behaviour for an op that torch_npu gives an AutogradPrivateUse1 kernel."""
    name = op.name()
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
        dk = _K.CompositeImplicitAutograd
        op_dk = op._op_dk

        def decomposed(*args, **kwargs):
            return op_dk(dk, *args, **kwargs)

        return decomposed
    if torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "AutogradOther"):

        ks = _AUTOGRAD_INPLACE_KEYSET if torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView") else _AUTOGRAD_KEYSET

        def autograd(*args, **kwargs):
            return op.redispatch(ks, *args, **kwargs)

        return autograd
    return None


def _op(name):
    try:
        return _layer._op_of(name)
    except (AttributeError, RuntimeError):  # torch_npu registers a few kernels for no schema
        return None


def autograd_restored(planned):
    """The aten ops whose autograd on the NPU is not torch's: those torch_npu gives an
    AutogradPrivateUse1 kernel, and composite ops (decomposed on every other device) with a
    PrivateUse1 kernel, for which the dispatcher prefers an autograd formula that calls an NPU-only
    backward (`matmul` -> `matmul_backward`) or none at all."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::") or _op(name) is None:
            continue
        if has(name, "AutogradPrivateUse1") or (name in planned and has(name, "CompositeImplicitAutograd")):
            out.append(name)
    return out


def plan():
    """(qualified name, op, impl) of the ops computed on the CPU for the NPU: those torch_npu or
    CUDA has a kernel for (a device's own computation) with a CPU kernel or a decomposition."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    computed = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    decompositions = torch._decomp.decomposition_table
    ops = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::") or not (has(name, "PrivateUse1") or has(name, "CUDA")):
            continue
        op = _op(name)
        if op is None or _layer._keep(name, op, KEEP) or name in _SPECIAL:
            continue
        if computed(name, "CPU"):
            ops.append((name, op, None))
        elif op in decompositions:
            ops.append((name, op, decompositions[op]))
    planned = {name for name, _, _ in ops}
    for name in _layer.EXTRA:
        if name not in planned:
            ops.append((name, _layer._op_of(name), None))
    return ops


# torch_npu's ops that launch nothing (allocation, its storage formats' bookkeeping, plain
# memory copies): they keep torch_npu's kernels. Its other ops without a CPU kernel are refused.
OWN_KEPT = frozenset(
    {
        "empty_with_format",
        "unsafe_empty_with_format",
        "empty_with_swapped_memory",
        "get_storage_size",
        "get_npu_format",
        "npu_change_data_ptr",
        "npu_format_cast",
        "npu_format_cast_",
        "_npu_format_cast",
        "_copy_from_and_resize",
        "copy_memory_",
        "save_npugraph_tensor",
    }
)


def refused(planned):
    """The ops (in the `aten` and `npu` namespaces) whose torch_npu kernel would launch an NPU
    kernel and that have no CPU kernel here: they raise, naming the op, before torch_npu's kernel
    runs (its failure would leave its task queue failing later operators silently)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        ns, _, rest = name.partition("::")
        if ns not in ("aten", "npu") or name in planned or not has(name, "PrivateUse1"):
            continue
        if rest.partition(".")[0] in OWN_KEPT:
            continue
        op = _op(name)
        if op is None or (ns == "aten" and _layer._keep(name, op, KEEP)):
            continue
        out.append((name, op))
    return out


def _refusing_kernel(name):
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{name} has no CPU implementation: tms_sim_torch cannot compute it on the simulated NPU "
            "(torch_npu's kernel needs CANN's operator libraries; see docs/simulator.md, "
            "\"torch_npu on the simulator\")"
        )

    refuse.__name__ = f"tms_sim_refused_{name.split('::', 1)[1].replace('.', '_')}"
    return refuse


_SPECIAL = {
    "aten::copy_": _copy_kernel,
    "aten::_to_copy": _to_copy_kernel,
    "aten::_lazy_clone": _lazy_clone_kernel,
    "aten::_fused_sdp_choice": _layer._fused_sdp_choice_kernel,
}


def register(rt):
    """Registers the PrivateUse1 kernels (once, after torch_npu's); returns how many ops."""
    global _acl_sync, _memcpy_sync, _memcpy_async, _raw_stream, _lib
    import torch_npu

    _acl_sync = rt.aclrtSynchronizeStream
    _acl_sync.argtypes = [ctypes.c_void_p]
    _acl_sync.restype = ctypes.c_int
    _memcpy_sync = rt.aclrtMemcpy
    _memcpy_sync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _memcpy_sync.restype = ctypes.c_int
    _memcpy_async = rt.aclrtMemcpyAsync
    _memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _memcpy_async.restype = ctypes.c_int
    _raw_stream = torch_npu._C._npu_getCurrentRawStream
    NPU.current = torch.npu.current_device
    lib = torch.library.Library("aten", "IMPL")
    count = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        ops = plan()
        for name, op, impl in ops:
            lib.impl(name.split("::", 1)[1], _layer._make_kernel(op, _layer._spec(op), impl, accel=NPU), NPU.key)
            count += 1
        for name, fn in _SPECIAL.items():
            lib.impl(name.split("::", 1)[1], fn, NPU.key)
            count += 1
        planned = {name for name, _, _ in ops} | set(_SPECIAL)
        npu_lib = torch.library.Library("npu", "IMPL")
        for name, op in refused(planned):
            ns, short = name.split("::", 1)
            try:
                (lib if ns == "aten" else npu_lib).impl(short, _refusing_kernel(name), "PrivateUse1")
            except RuntimeError:  # torch_npu's own Python kernel (torch.library allows one)
                continue
        for name in autograd_restored(planned):
            fn = _autograd_kernel(_op(name))
            if fn is not None:
                lib.impl(name.split("::", 1)[1], fn, "AutogradPrivateUse1")
    _lib = (lib, npu_lib)
    return count
