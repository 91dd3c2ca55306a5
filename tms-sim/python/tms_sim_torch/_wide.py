"""Wide reductions: float sums and means accumulated in float64 (`TMS_SIM_WIDE_REDUCTIONS=1`).

By default the layer gives the CPU's exact numbers, and the CPU sums a float32 tensor in float32.
Its rounding error grows with the tensor: `(torch.ones(10**9) * 101).mean()` is 101.000015 on the
CPU, where a GPU, whose reduction adds many short partial sums in a tree, gives 101.0. Programs
that compare such a result with `==` (torch_memory_saver's `cuda_graph` test does) fail on the
CPU's numbers. With this switch on, `sum` and `mean` of float16, bfloat16 and float32 tensors add
in float64 and round once to the result's dtype: as close to the exact value as the dtype allows,
which is what both a GPU's tree and the CPU approximate. Other ops keep the CPU's numbers.

Chunks of at most `CHUNK` elements are widened at a time, so a 10⁹-element tensor needs 32 MiB
of scratch rather than a float64 copy of itself.
"""

import os

import torch

CHUNK = 1 << 22
_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_F64 = torch.float64

# The aten ops replaced, with their positional parameters after `self`.
OPS = {
    "aten::sum.default": (),
    "aten::sum.dim_IntList": ("dim", "keepdim"),
    "aten::mean.default": (),
    "aten::mean.dim": ("dim", "keepdim"),
}


def enabled():
    return os.environ.get("TMS_SIM_WIDE_REDUCTIONS", "0") not in ("", "0")


def make(op, name):
    """The CPU function computing `op` (one of OPS) widely; it falls back to `op` itself for
    integer, bool, complex and float64 inputs, 0-d and empty tensors."""
    params = OPS[name]
    is_mean = name.startswith("aten::mean")

    def wide(self, *args, dtype=None, **kwargs):
        bound = dict(zip(params, args))
        bound.update(kwargs)
        out_dtype = dtype if dtype is not None else self.dtype
        if self.dtype not in _NARROW or out_dtype not in _NARROW or self.dim() == 0 or self.numel() == 0:
            return op(self, *args, dtype=dtype, **kwargs)
        dim = bound.get("dim")
        keepdim = bool(bound.get("keepdim", False))
        dims = _reduced(self, dim)
        total = _sum64(self, dims)
        if is_mean:
            count = 1
            for d in dims:
                count *= self.size(d)
            total = total / count
        if not keepdim:
            for d in sorted(dims, reverse=True):
                total = total.squeeze(d)
        return total.to(out_dtype)

    wide.__name__ = f"tms_sim_wide_{op.__name__}"
    return wide


def _reduced(t, dim):
    """The dimensions `dim` names (every one for None or an empty list, as aten reads them)."""
    if dim is None:
        return list(range(t.dim()))
    if isinstance(dim, int):
        dim = [dim]
    dims = sorted({d % t.dim() for d in dim})
    return dims or list(range(t.dim()))


def _sum64(t, dims):
    """Float64 sum of `t` over `dims`, keeping them as size-1 dimensions."""
    if t.numel() <= CHUNK:
        return t.to(_F64).sum(dims, keepdim=True)
    # Slices along the longest reduced dimension, each widened on its own.
    d = max(dims, key=t.size)
    per_index = t.numel() // t.size(d)
    step = max(1, CHUNK // max(1, per_index))
    total = None
    for start in range(0, t.size(d), step):
        part = t.narrow(d, start, min(step, t.size(d) - start)).to(_F64).sum(dims, keepdim=True)
        total = part if total is None else total.add_(part)
    return total
