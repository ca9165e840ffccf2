"""The FP8 (e4m3) forward's host path: its problem (validation), descale factors, tensor maps and launch of
fwd_sm90_fp8_kernel (cuda/fwd_sm90_fp8.cuh; config.FwdSm90Fp8Config).

FP8 data lives in CuPy uint8 arrays holding e4m3fn bit patterns: CuPy (14.2) cannot hold ml_dtypes.float8_e4m3fn
arrays, and a uint8 array has no other meaning as an attention input. `cuflash.fp8.quantize` makes them. Each of q,
k, v comes with float32 descale factors (the real value of an element is e4m3 * descale): a number, or a CuPy float32
array of shape (), (1,), (batch, heads) or (batch, heads, ceil(seqlen / 128)) (blocks of 128 rows of one
(batch, head)), heads being q's heads for q_descale and the K/V heads for k_descale and v_descale.
"""
from __future__ import annotations

import math
import numbers
import threading
from functools import partial
from typing import NamedTuple

import numpy as np

from . import _families, _launch, _plan, _problem, _tma, _validate, config
from ._validate import Dims, Mods

QUANT_BLOCK_ROWS = 128  # cuda/fwd_sm90_fp8.cuh QUANT_BLOCK_ROWS: the rows of one block's descale
HEAD_DIMS = tuple(config.FWD_SM90_FP8_TILES)
OUT_DTYPES = ("bf16", "fp16")
_REFUSED = ("alibi_slopes", "softcap", "bias", "mask", "key_padding_mask", "dropout_p", "return_dropout_mask")


def is_fp8(x) -> bool:
    """Whether x is a CuPy uint8 array: FP8 (e4m3 bits) input to attention."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and dtype == np.uint8 and type(x).__module__.startswith("cupy")


class Descaled(NamedTuple):
    """One operand's descale factors as the kernel reads them: address and (batch, head, block) strides in elements
    (0 broadcasts). A number (or None) is validated here but put on the GPU only at the launch (`_descale_ptr`), so
    that no argument's error comes after a GPU allocation: then ptr is 0 and `array` holds the float."""

    ptr: int
    strides: tuple
    array: object


class Fp8Attention(NamedTuple):
    """A validated FP8 forward call (dense batches)."""

    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    q: Dims
    k: Dims
    v: Dims
    infos: tuple
    scale: float
    mods: Mods
    device: int
    out: str  # "bf16" | "fp16"
    descales: tuple  # Descaled of q, k, v
    total_q: int = 0  # packed (layout "packed"): rows of q and k; batch = sequences, seqlen_* = the longest
    total_k: int = 0

    @property
    def packed(self) -> bool:
        return self.layout == "packed"


def _out_dtype(out_dtype) -> str:
    if out_dtype is None:
        return "bf16"
    if isinstance(out_dtype, str) and out_dtype in ("bf16", "bfloat16", "fp16", "float16"):
        return "bf16" if out_dtype.startswith("b") else "fp16"
    try:
        dt = np.dtype(out_dtype)
    except TypeError:
        dt = None
    if dt == np.float16:
        return "fp16"
    if dt is not None and dt == _validate.BF16:
        return "bf16"
    raise ValueError(f"out_dtype={out_dtype!r} is not supported for FP8 attention; allowed: None (bfloat16), "
                     f"'bf16' / ml_dtypes.bfloat16 or 'fp16' / numpy.float16")


_ONES: dict = {}  # (device, value) -> a 1-element float32 array holding value
_ONES_LOCK = threading.Lock()


def _scalar_array(cp, device: int, value: float):
    """A 1-element float32 array holding value. The arrays of 1.0 (a descale given as None) are never dropped; a
    plan holds the others whose addresses its launch arguments hold (`_plan.PlanBuilder.hold`)."""
    key = (device, value)
    a = _ONES.get(key)
    if a is None:
        with _ONES_LOCK:
            if len(_ONES) > 64:
                for k in [k for k in _ONES if k[1] != 1.0]:
                    del _ONES[k]
            a = _ONES[key] = cp.full((1,), value, dtype=cp.float32)
    return a


def _descale(x, name: str, batch: int, heads: int, seqlen: int, device: int, heads_what: str) -> Descaled:
    """The kernel's view of one descale argument; a clear error for anything it cannot be."""
    blocks = math.ceil(seqlen / QUANT_BLOCK_ROWS)
    allowed = (f"None (1.0), a number > 0, or a CuPy float32 array of shape (), (1,), (batch, {heads_what}) = "
               f"{(batch, heads)} or (batch, {heads_what}, ceil(seqlen / {QUANT_BLOCK_ROWS})) = {(batch, heads, blocks)}")
    if x is None or (isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))):
        value = 1.0 if x is None else float(x)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={x!r} must be finite and > 0")
        return Descaled(0, (0, 0, 0), value)
    info = _validate.array_info(x, name)
    if info.dtype != np.float32:
        raise TypeError(f"{name}.dtype={info.dtype} is not supported; {name} must be {allowed}")
    if info.device != device:
        raise ValueError(f"{name} is on device {info.device} but q is on device {device}")
    shape = tuple(info.shape)
    if shape in ((), (1,)):
        return Descaled(info.ptr, (0, 0, 0), None)
    if shape not in ((batch, heads), (batch, heads, blocks)):
        raise ValueError(f"{name} has shape {shape}; allowed: {allowed}")
    if any(not float(s).is_integer() for s in info.strides):
        raise ValueError(f"{name} has strides {info.strides} (elements) that are not whole elements")
    strides = [0 if n == 1 else int(s) for n, s in zip(shape, info.strides)] + [0] * (3 - len(shape))
    if any(abs(s) >= 2**31 for s in strides):
        raise ValueError(f"{name} has strides {info.strides}: too large for the kernel's 32-bit strides")
    return Descaled(info.ptr, tuple(strides), None)


def _descales(args: tuple, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int,
              device: int) -> tuple:
    """Descaled of q_descale, k_descale, v_descale (`args`): q's per query head, k's and v's per K/V head."""
    return tuple(_descale(x, name, batch, heads, seqlen, device, what)
                 for x, name, heads, seqlen, what in zip(args, ("q_descale", "k_descale", "v_descale"),
                                                         (heads_q, heads_kv, heads_kv), (seqlen_q, seqlen_k, seqlen_k),
                                                         ("heads", "heads_kv", "heads_kv")))


def _check_inputs(q, k, v, refused: dict):
    """ArrayInfo of q, k, v after the checks every FP8 call makes: uint8 arrays, no refused argument given."""
    qi, ki, vi = _validate.array_info(q, "q"), _validate.array_info(k, "k"), _validate.array_info(v, "v")
    for info in (qi, ki, vi):
        if info.dtype != np.uint8:
            raise TypeError(f"{info.name}.dtype={info.dtype}: FP8 attention takes q, k and v as CuPy uint8 arrays of "
                            f"e4m3 bits (cuflash.fp8.quantize), all three; got q.dtype={qi.dtype}, k.dtype={ki.dtype}, "
                            f"v.dtype={vi.dtype}")
    for name, value in refused.items():
        given = value is not None and value is not False and not (isinstance(value, numbers.Real) and value == 0)
        if given:
            shown = value if isinstance(value, numbers.Real) else repr(value) if isinstance(value, str) else \
                f"<{type(value).__name__}>"
            raise ValueError(f"{name}={shown} is not supported with FP8 inputs: FP8 attention takes causal and window "
                             f"(and GQA); {', '.join(_REFUSED)} need float16, bfloat16 or float32 inputs")
    return qi, ki, vi


def _check_device(device: int) -> None:
    """FP8 attention runs only on the Hopper FP8 kernels: refuse the call, before anything is allocated, where they
    do not run (another GPU, or CUFLASH_KERNELS=mma)."""
    arch = _launch.device_arch(device)
    if not config.uses_wgmma(arch):
        here = f"this GPU is {arch}" if arch != "sm_90a" else f"CUFLASH_KERNELS={config.KERNELS} turns them off"
        raise TypeError(f"q.dtype=uint8 (FP8 e4m3 inputs) needs the Hopper FP8 kernels, which run on sm_90 GPUs "
                        f"with CUFLASH_KERNELS=auto; {here}: pass float16, bfloat16 or float32 inputs instead")


def _check_head_dim(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} (last dim of q) is not supported for FP8 inputs; allowed: "
                         f"{', '.join(map(str, HEAD_DIMS))}")


def problem_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   check_inputs, window, q_descale, k_descale, v_descale, out_dtype, refused: dict) -> Fp8Attention:
    """The FP8 forward's problem for packed sequences (attention_varlen_forward's arguments). Descale blocks are
    counted within each sequence: (batch, heads, ceil(max_seqlen / 128)) for batch = len(cu_seqlens) - 1."""
    causal = _validate.check_flag(causal, "causal")
    check_inputs = _validate.check_flag(check_inputs, "check_inputs")
    qi, ki, vi = _check_inputs(q, k, v, refused)
    cqi, cki = _validate.array_info(cu_seqlens_q, "cu_seqlens_q"), _validate.array_info(cu_seqlens_k, "cu_seqlens_k")
    m = _validate.check_varlen(qi, ki, vi, cqi, cki, max_seqlen_q, max_seqlen_k, fp8=True)
    _check_head_dim(m.head_dim)
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    out = _out_dtype(out_dtype)
    mods = _problem._mods(causal, window, None, None, 0.0, None, 0, m.batch, m.heads_q, m.device, "bf16",
                          m.max_seqlen_q, m.max_seqlen_k)
    descales = _descales((q_descale, k_descale, v_descale), m.batch, m.heads_q, m.heads_kv, m.max_seqlen_q,
                         m.max_seqlen_k, m.device)
    _check_device(m.device)
    if check_inputs:  # one device -> host copy of batch + 1 ints each (a synchronization)
        cp = _launch.cupy()
        with _launch.on_device(cp, m.device):
            _validate.check_cu_seqlens_values(cp.asnumpy(cu_seqlens_q), cp.asnumpy(cu_seqlens_k), m.total_q,
                                              m.total_k, m.max_seqlen_q, m.max_seqlen_k)
    return Fp8Attention("packed", m.batch, m.heads_q, m.heads_kv, m.head_dim, m.max_seqlen_q, m.max_seqlen_k,
                        _problem.packed_dims(qi), _problem.packed_dims(ki), _problem.packed_dims(vi), (qi, ki, vi),
                        scale, mods, m.device, out, descales, m.total_q, m.total_k)


def problem(q, k, v, causal, softmax_scale, layout, window, q_descale, k_descale, v_descale, out_dtype,
            refused: dict) -> Fp8Attention:
    """The FP8 forward's problem; `refused`: the score-modifier arguments FP8 attention does not take, by name."""
    causal = _validate.check_flag(causal, "causal")
    layout = _validate.check_layout(layout)
    qi, ki, vi = _check_inputs(q, k, v, refused)
    dq, dk, dv = (_validate.bshd_dims(i, layout) for i in (qi, ki, vi))
    _check_head_dim(dq.head_dim)
    for other, d in ((ki, dk), (vi, dv)):
        if d.batch != dq.batch or d.head_dim != dq.head_dim:
            raise ValueError(f"{other.name} has shape {other.shape} but q has {qi.shape} ({layout}): batch and "
                             f"head_dim must match")
    if dv.heads != dk.heads or dv.seqlen != dk.seqlen:
        raise ValueError(f"v has shape {vi.shape} but k has {ki.shape} ({layout}): k and v need the same heads and seqlen")
    _validate.check_gqa_heads(dq.heads, dk.heads, qi, ki, layout)
    for name, n in (("batch", dq.batch), ("heads", dq.heads)):
        if n > _validate.MAX_GRID_YZ:
            raise ValueError(f"{name}={n} (from q.shape={qi.shape}) is too large: at most {_validate.MAX_GRID_YZ}")
    _validate.check_same_device(qi, ki, vi)
    scale = _validate.check_softmax_scale(softmax_scale, dq.head_dim)
    out = _out_dtype(out_dtype)
    mods = _problem._mods(causal, window, None, None, 0.0, None, 0, dq.batch, dq.heads, qi.device, "bf16",
                          dq.seqlen, dk.seqlen)
    descales = _descales((q_descale, k_descale, v_descale), dq.batch, dq.heads, dk.heads, dq.seqlen, dk.seqlen,
                         qi.device)
    _check_device(qi.device)
    return Fp8Attention(layout, dq.batch, dq.heads, dk.heads, dq.head_dim, dq.seqlen, dk.seqlen, dq, dk, dv,
                        (qi, ki, vi), scale, mods, qi.device, out, descales)


def forward(a: Fp8Attention, arrays, *, with_lse: bool, cu_seqlens=None, key=None):
    """Launch the FP8 forward of problem `a` on arrays = (q, k, v); returns (o, lse), or o alone. cu_seqlens: the
    (q, k) offsets of a packed problem. key: the call's plan key, or None; a call that launches on its arrays in place
    records a plan whose replay takes (q, k, v, alibi_slopes, bias, mask, key_padding_mask, q_descale, k_descale,
    v_descale), then cu_seqlens_q, cu_seqlens_k if packed; a descale array is bound per call, a number (or None) is
    in the key and its one-element array held by the plan."""
    cp = _launch.cupy()
    out_np = np.float16 if a.out == "fp16" else _validate.BF16
    with _launch.on_device(cp, a.device):
        o, od = _families._new_like(a.q, a.layout, out_np, cp)
        lse = None
        if with_lse:
            lse = cp.empty((a.heads_q, a.total_q) if a.packed else (a.batch, a.heads_q, a.seqlen_q), dtype=cp.float32)
        if o.size == 0:
            return (o, lse) if with_lse else o
        if (a.total_k if a.packed else a.seqlen_k) == 0:  # no keys: every row is fully masked
            o.fill(0)
            if with_lse:
                lse.fill(-cp.inf)
            return (o, lse) if with_lse else o
        cfg, kernel = _families._kernel("forward_fp8", a.device, a.head_dim, a.out, a.mods.causal, a.mods.bits,
                                        seqlen_k=a.seqlen_k)
        boxes = ((cfg.block_m, cfg.box_bytes), (cfg.block_n, cfg.box_bytes), (cfg.block_n, cfg.box_bytes))
        operands, keep = [], []
        for x, dims, (rows, cols) in zip(arrays, (a.q, a.k, a.v), boxes):
            if _tma.tma_unsupported(x, dims, "fp8", rows, cols) is not None:  # e.g. odd strides: a copy
                x = x.copy()  # C-contiguous, at an aligned address of its own
                keep.append(x)
                info = _validate.array_info(x, "copy")
                dims = _problem.packed_dims(info) if a.packed else _validate.bshd_dims(info, a.layout)
            operands.append((x, dims))
        maps = _families._TmaMaps("fp8", tuple(d for _, d in operands), boxes, _tma.FwdFp8Params, "fwd")
        lse_strides = (0, a.total_q) if a.packed else (a.heads_q * a.seqlen_q, a.seqlen_q)
        cu = () if cu_seqlens is None else (cu_seqlens[0].data.ptr, cu_seqlens[1].data.ptr)
        fwd = _launch.FwdParams(
            0, 0, 0, o.data.ptr, 0 if lse is None else lse.data.ptr,
            _launch.seq_params(a.seqlen_q, a.seqlen_k, a.heads_q // a.heads_kv, *cu),
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, *(od.batch_stride, od.row_stride, od.head_stride), *lse_strides,
            0, 0, a.heads_q, a.head_dim, 0, 0, 1, 1, a.scale * _launch.LOG2E, 0)
        if a.mods.bits:
            fwd.mods = _families.mod_params(a.mods, a.scale, max(a.seqlen_q, a.seqlen_k))
        params = maps.params(fwd, tuple(x for x, _ in operands))
        fields = ("q_descale", "k_descale", "v_descale")
        scalars = []  # the one-element arrays of descales given as numbers (or None: 1.0)
        for field, d in zip(fields, a.descales):
            if isinstance(d.array, float):
                scalars.append(_scalar_array(cp, a.device, d.array))
                ptr = scalars[-1].data.ptr
            else:
                ptr = d.ptr
            setattr(params, field, _tma.Descale(ptr, *d.strides, 0))
        grid, params.m_blocks, params.items = cfg.schedule(a.batch, a.heads_q, a.seqlen_q,
                                                           _families._sm_count(a.device))
        queue = cfg.uses_queue(a.packed)
        if queue:  # two counters that each launch on the stream leaves at zero
            params.queue = _families._queue_ptr(a.device, cp.cuda.get_current_stream().ptr)
        if key is not None and not keep:  # later calls of this signature replay the launch
            n = 10 if cu_seqlens is None else 12
            b = _plan.PlanBuilder(a.device, n)
            for x in scalars:  # (a number is in the key; its array may leave _scalar_array's cache)
                b.hold(x)
            b.derive((0, 1, 2), params, "tma_q", maps.words)
            if cu_seqlens is not None:
                b.bind(10, params, "fwd.seq.cu_seqlens_q")
                b.bind(11, params, "fwd.seq.cu_seqlens_k")
            for i, (field, d) in enumerate(zip(fields, a.descales)):
                if d.array is None:  # an array: its address goes in per call
                    b.bind(7 + i, params, field + ".ptr")
            b.alloc(o.shape, o.dtype, (params, "fwd.o"))
            if with_lse:
                b.alloc(lse.shape, lse.dtype, (params, "fwd.lse"))
            if queue:
                b.per_stream(params, "queue", partial(_families._queue_ptr, a.device))
            b.launch(kernel, grid, params)
            _plan.plans.put(key, b.plan(aligned=(0, 1, 2), returns=(n, n + 1) if with_lse else n))
        kernel.launch(grid, params, cp.cuda.get_current_stream().ptr)
    return (o, lse) if with_lse else o


def attention(q, k, v, causal, softmax_scale, layout, window, q_descale, k_descale, v_descale, out_dtype,
              refused: dict, with_lse: bool, key=None):
    """cuflash.attention / attention_forward on FP8 inputs; key: the call's plan key, or None."""
    a = problem(q, k, v, causal, softmax_scale, layout, window, q_descale, k_descale, v_descale, out_dtype, refused)
    return forward(a, (q, k, v), with_lse=with_lse, key=key)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     check_inputs, window, q_descale, k_descale, v_descale, out_dtype, refused: dict, with_lse: bool,
                     key=None):
    """cuflash.attention_varlen / attention_varlen_forward on FP8 inputs; key: the call's plan key, or None."""
    a = problem_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                       check_inputs, window, q_descale, k_descale, v_descale, out_dtype, refused)
    return forward(a, (q, k, v), with_lse=with_lse, cu_seqlens=(cu_seqlens_q, cu_seqlens_k), key=key)


def refuse_descales(q_descale, k_descale, v_descale, out_dtype) -> None:
    """Descales and out_dtype belong to FP8 inputs: a clear error when given with other dtypes."""
    for name, value in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                        ("out_dtype", out_dtype)):
        if value is not None:
            raise ValueError(f"{name} applies to FP8 inputs only (q, k, v as CuPy uint8 arrays of e4m3 bits, "
                             f"cuflash.fp8.quantize); these inputs are not FP8: pass {name}=None")
