"""The layout of an op's results, remembered per layout of its operands.

A queued or captured kernel must return its results before computing them, so `_graphs.capture`
runs the op on meta stand-ins of its operands. That meta run is most of what queuing an op costs
(Python meta kernels and decompositions: about 0.7 ms an op on the 2-core CI machine, against a
few microseconds for the CPU kernel of a small op), and a training loop calls the same ops on the
same layouts at every step. So the outcome of a meta run is kept as a *plan* (which results are
operands, views of an operand's storage, or new tensors of which sizes, strides and dtype), keyed
by everything a meta kernel can read:

- the op;
- each CUDA operand's sizes, strides, storage offset, dtype, conj and neg bits, storage size, and
  which operands share a storage;
- every other argument, with its Python type (type promotion tells `1` from `1.0` and `True`),
  and its value, except for pointwise ops (`torch.Tag.pointwise`, and the `_foreach_` ops, which
  apply a pointwise op per tensor), whose results' layout a scalar's value never changes; this
  keeps the hit for an optimizer's per-step scalars (bias corrections, learning rates);
- a CPU tensor argument's sizes, strides and dtype, and a 0-dim one's value unless the op is
  pointwise (a meta kernel gets a 0-dim CPU tensor as it is, and could read it).

A meta kernel has no data to read, so nothing else can change its results. A run that resized an
out= operand is not kept (the resize is the plan's side effect, done once per call), and an
argument that cannot be hashed makes the call run the meta kernel as before.
"""

import torch

_Tensor = torch.Tensor
_STRIDED = torch.strided
_empty_strided = torch.empty_strided
_set_conj = torch._C._set_conj
_set_neg = torch._C._set_neg

_MAX_PLANS = 4096  # a program whose layouts never repeat cannot grow the cache past this

_plans = {}
_loose = {}  # op -> whether scalar values leave its results' layout alone
hits = 0
misses = 0

_OPERAND, _VIEW, _NEW, _SEQ, _VALUE = range(5)


class NotStrided(Exception):
    """A result in another layout than strided (sparse, nested): the caller cannot capture it."""


class Slot:
    """Stands, in a node's argument template, for the CUDA operand recorded as `snaps[index]`."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def _is_loose(op):
    v = _loose.get(op)
    if v is None:
        v = _loose[op] = torch.Tag.pointwise in op.tags or op._schema.name.startswith("aten::_foreach_")
    return v


def _frozen(v, loose):
    """A hashable stand-in for argument `v` of a template (raises TypeError when there is none)."""
    if isinstance(v, Slot):
        return (Slot, v.index)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_frozen(x, loose) for x in v))
    if isinstance(v, _Tensor):  # a CPU tensor: CUDA ones are slots
        if v.layout is not _STRIDED:
            raise TypeError("not strided")
        value = v.item() if v.dim() == 0 and not loose else None
        return (_Tensor, tuple(v.size()), tuple(v.stride()), v.dtype, value)
    if loose and isinstance(v, (bool, int, float, complex)):
        return type(v)
    return (type(v), v)


def key(op, targs, tkwargs, snaps):
    """The cache key of a call (`snaps`: `_graphs._snap` of each operand, by slot), or None."""
    ordinals = {}
    operands = tuple(
        # An empty storage has no address to share: each is its own (as `_graphs._storage_key`).
        (size, stride, off, dtype, conj, neg, ordinals.setdefault(ptr if n else object(), len(ordinals)), n)
        for ptr, n, off, size, stride, dtype, conj, neg in snaps
    )
    loose = _is_loose(op)
    try:
        k = (
            op,
            operands,
            tuple(_frozen(v, loose) for v in targs),
            tuple((name, _frozen(v, loose)) for name, v in tkwargs.items()),
        )
        hash(k)
    except TypeError:
        return None
    return k


def lookup(k):
    global hits, misses
    plan = _plans.get(k) if k is not None else None
    if plan is None:
        misses += 1
    else:
        hits += 1
    return plan


def remember(k, plan):
    if k is None:
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[k] = plan


def plan_of(m, stand_ins, owner_slots):
    """The plan of meta result `m`. `stand_ins`: id(stand-in) -> (stand-in, slot) of the operands'
    stand-ins; `owner_slots`: stand-in storage `_cdata` -> slot of the first operand with it."""
    if isinstance(m, _Tensor):
        ent = stand_ins.get(id(m))
        if ent is not None and ent[0] is m:
            return (_OPERAND, ent[1])
        if m.layout is not _STRIDED:
            raise NotStrided(str(m.layout))
        layout = (m.storage_offset(), tuple(m.size()), tuple(m.stride()), m.dtype, m.is_conj(), m.is_neg())
        owner = owner_slots.get(m.untyped_storage()._cdata)
        if owner is not None:
            return (_VIEW, owner) + layout
        return (_NEW,) + layout[1:4]
    if isinstance(m, (tuple, list)):
        return (_SEQ, type(m), tuple(plan_of(x, stand_ins, owner_slots) for x in m))
    return (_VALUE, m)


def materialize(plan, operands, device, new, path=()):
    """The results `plan` describes, on `operands` (CUDA tensors by slot); each new result is
    allocated on `device` from torch's caching allocator and passed to `new(path, tensor)`."""
    kind = plan[0]
    if kind == _OPERAND:
        return operands[plan[1]]
    if kind == _VIEW:
        _, owner, off, size, stride, dtype, conj, neg = plan
        v = _empty_strided((0,), (1,), dtype=dtype, device=device)
        v = v.set_(operands[owner].untyped_storage(), off, size, stride)
        if conj:
            _set_conj(v, True)
        if neg:
            _set_neg(v, True)
        return v
    if kind == _NEW:
        t = _empty_strided(plan[1], plan[2], dtype=plan[3], device=device)
        new(path, t)
        return t
    if kind == _SEQ:
        return plan[1](materialize(x, operands, device, new, path + (i,)) for i, x in enumerate(plan[2]))
    return plan[1]


def stats():
    """(hits, misses, plans kept): for tests and benchmarks."""
    return hits, misses, len(_plans)
