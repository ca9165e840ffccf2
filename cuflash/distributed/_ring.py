"""Ring attention, written once per rank and run by two drivers.

Each rank's work is a generator (`forward_rank`, `backward_rank`) that computes with an `ops` object and yields
two kinds of message to its driver:
  Start(arrays)   send these arrays to the next rank (rank + 1) and receive as many of the same shapes and dtypes
                  from the previous one; the driver answers with a handle at once (the transfer runs meanwhile)
  Wait(handle)    the driver answers with the received arrays, usable by work queued from now on
The NCCL driver (_group.NcclTransport) runs one generator per process, the transfer on its own stream overlapped
with the kernels; `run_local` runs all P generators of a simulated ring in one process, in lockstep, and passes
copies. Both run the same step plans, kernel calls and merges, so a one-GPU simulation checks the algorithm that
the GPUs run, and on NumPy arrays (float64 reference math, `NumpyOps`) the CPU checks it too.

Forward, rank r (Q_r stays; K/V blocks travel r -> r + 1):
  for step s = 0 .. P-1, holding the block of src = (r - s) mod P:
      start passing the block on (not at the last step)
      for each block of the step plan (RingOptions.blocks: _sharding.step_blocks; packed_step_blocks for packed
      batches, whose rows may be index arrays: gathered, merged, scattered back):
          O_b, lse_b = attention(Q_r[rows], K_src[krows], V_src[krows])       the kernels' forward
          lse' = logaddexp(lse, lse_b); O = O e^(lse - lse') + O_b e^(lse_b - lse')   (rows of the block)
      wait for the next block
Backward, rank r, with the merged O and lse of the forward (P_ij = exp(S_ij - lse_i) and D_i = rowsum(dO_i O_i)
are then the global ones, so each block's gradients are exact partial sums):
  for step s, holding block src and dK_src, dV_src accumulated by the ranks it visited before:
      start passing on the block (not at the last step) and the dK/dV sums of the block held at step s-1
      dQ_r += dQ_b; dK_b, dV_b kept                                          the kernels' backward per Block
      wait; dK_src = received sums (zero at step 0) + dK_b, dV_src likewise
  a last exchange brings every block's dK, dV home (rank src) after its P visits.
Sums run in float32 (float64 for float64 inputs) and are rounded to the input dtype once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _sharding


@dataclass
class Start:
    arrays: tuple


@dataclass
class Wait:
    handle: object


@dataclass(frozen=True)
class RingOptions:
    causal: bool
    sharding: str
    layout: str  # "bshd" | "bhsd" | "packed"
    local_lengths: tuple = ()  # packed: every sequence's local length

    @property
    def seq_axis(self) -> int:  # the row axis of q, k, v, o and the gradients
        return {"bshd": 1, "bhsd": 2, "packed": 0}[self.layout]

    @property
    def lse_axis(self) -> int:  # lse: (batch, heads, seqlen), packed (heads, total)
        return 1 if self.layout == "packed" else 2

    def blocks(self, rank: int, src: int, world_size: int, n: int):
        if self.layout == "packed":
            return _sharding.packed_step_blocks(rank, src, world_size, self.causal, self.sharding, self.local_lengths)
        return _sharding.step_blocks(rank, src, world_size, self.causal, self.sharding, n)


_rows = _sharding.take_rows


def forward_rank(rank: int, world_size: int, q, k, v, ops, opt: RingOptions):
    """Generator: rank's ring forward; returns (o, lse) of its local queries (module docstring)."""
    ax = opt.seq_axis
    o_acc, lse_acc = ops.new_output(q)
    block_kv = (k, v)
    for step in range(world_size):
        src = _sharding.step_source(rank, step, world_size)
        pending = (yield Start(block_kv)) if step + 1 < world_size else None
        for b in opt.blocks(rank, src, world_size, q.shape[ax]):
            o_b, lse_b = ops.forward(_rows(q, b.q_rows, ax), _rows(block_kv[0], b.k_rows, ax),
                                     _rows(block_kv[1], b.k_rows, ax), b)
            ops.merge(o_acc, lse_acc, b.q_rows, o_b, lse_b)
        if pending is not None:
            block_kv = yield Wait(pending)
    return ops.finish(o_acc), ops.finish_lse(lse_acc)


def backward_rank(rank: int, world_size: int, dout, q, k, v, out, lse, ops, opt: RingOptions):
    """Generator: rank's ring backward; returns (dq, dk, dv) of its local rows (module docstring)."""
    ax, lax = opt.seq_axis, opt.lse_axis
    dq_acc = ops.zeros(q.shape)
    block_kv = (k, v)
    held_sums = None  # dK, dV sums of the block held at the previous step, complete with this rank's part
    for step in range(world_size):
        src = _sharding.step_source(rank, step, world_size)
        sends = (block_kv if step + 1 < world_size else ()) + (held_sums if step > 0 else ())
        pending = (yield Start(sends)) if sends else None
        parts = []
        for b in opt.blocks(rank, src, world_size, q.shape[ax]):
            r = b.q_rows
            dq_b, dk_b, dv_b = ops.backward(_rows(dout, r, ax), _rows(q, r, ax), _rows(block_kv[0], b.k_rows, ax),
                                            _rows(block_kv[1], b.k_rows, ax), _rows(out, r, ax), _rows(lse, r, lax),
                                            b)
            ops.accumulate(dq_acc, r, dq_b)
            parts.append((b.k_rows, dk_b, dv_b))
        received = (yield Wait(pending)) if pending is not None else ()
        next_kv = tuple(received[:2]) if step + 1 < world_size else None
        sums = tuple(received[-2:]) if step > 0 else (ops.zeros(k.shape), ops.zeros(v.shape))
        for k_rows, dk_b, dv_b in parts:
            ops.accumulate(sums[0], k_rows, dk_b)
            ops.accumulate(sums[1], k_rows, dv_b)
        held_sums = sums
        block_kv = next_kv
    if world_size > 1:  # the sums of the block held last belong to the next rank: every block goes home
        held_sums = yield Wait((yield Start(held_sums)))
    return ops.finish(dq_acc), ops.finish(held_sums[0]), ops.finish(held_sums[1])


@dataclass
class _Done:
    value: object


def run_local(generators, copy, trace: list | None = None):
    """Run the generators of ranks 0..P-1 of a simulated ring in lockstep; returns their results.

    copy(x) -> an independent array (what NCCL's receive buffer holds). trace, when a list, receives the bytes
    each rank sends at each exchange."""
    world_size = len(generators)
    replies = [None] * world_size
    exchanges = []
    while True:
        messages = []
        for g, reply in zip(generators, replies):
            try:
                messages.append(g.send(reply))
            except StopIteration as stop:
                messages.append(_Done(stop.value))
        kinds = {type(m) for m in messages}
        if len(kinds) != 1:  # every rank runs the same steps: a divergence is a bug here, not a user error
            raise RuntimeError(f"simulated ranks diverged: {[type(m).__name__ for m in messages]}")
        kind = kinds.pop()
        if kind is _Done:
            return [m.value for m in messages]
        if kind is Start:
            received = [tuple(copy(a) for a in messages[(r - 1) % world_size].arrays) for r in range(world_size)]
            exchanges.append(received)
            replies = [(len(exchanges) - 1, r) for r in range(world_size)]
            if trace is not None:
                trace.append(sum(int(a.nbytes) for a in messages[0].arrays))
        else:
            replies = [exchanges[m.handle[0]][m.handle[1]] for m in messages]


def run(generator, transport):
    """Run one rank's generator over a transport (start(arrays) -> handle, wait(handle) -> arrays)."""
    reply = None
    while True:
        try:
            message = generator.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = transport.start(message.arrays) if isinstance(message, Start) else transport.wait(message.handle)


# --- the arithmetic of a rank: kernels on CuPy arrays, float64 reference math on NumPy arrays ---------------------

def _put_rows(x, rows, axis: int, value) -> None:
    index = [slice(None)] * x.ndim
    index[axis] = rows
    x[tuple(index)] = value


class _Ops:
    """What both kinds of ops share: the accumulator shapes, and merges / sums into a block's rows, which are a
    view for a slice of rows and a gather, update and scatter for the index arrays of packed halves."""

    def __init__(self, opt: RingOptions, scale: float, softcap):
        self.opt, self.layout, self.scale, self.softcap = opt, opt.layout, scale, softcap

    def new_output(self, q):
        """(O = 0, lse = -inf) accumulators of q's rows."""
        if self.layout == "packed":
            shape = (q.shape[1], q.shape[0])  # (heads, total)
        else:
            b, h = q.shape[0], q.shape[2 if self.layout == "bshd" else 1]
            shape = (b, h, q.shape[self.opt.seq_axis])
        return self._zeros(q.shape), self._full(shape, -np.inf)

    def zeros(self, shape):
        return self._zeros(shape)

    def _lse_as_rows(self, x):  # lse (.., rows) -> broadcastable against the rows of O (.., D)
        if self.layout == "bshd":
            return x.transpose(0, 2, 1)[..., None]
        return x.T[..., None] if self.layout == "packed" else x[..., None]

    def merge(self, o_acc, lse_acc, rows, o_b, lse_b):
        """lse' = logaddexp(lse, lse_b); O = O e^(lse - lse') + O_b e^(lse_b - lse') on the block's rows."""
        ax, lax = self.opt.seq_axis, self.opt.lse_axis
        o_sub, lse_sub = _rows(o_acc, rows, ax), _rows(lse_acc, rows, lax)
        self._merge(o_sub, lse_sub, o_b, lse_b)
        if not isinstance(rows, slice):  # gathered copies: back into place
            _put_rows(o_acc, rows, ax, o_sub)
            _put_rows(lse_acc, rows, lax, lse_sub)

    def accumulate(self, acc, rows, part):
        sub = _rows(acc, rows, self.opt.seq_axis)
        self._accumulate(sub, part)
        if not isinstance(rows, slice):
            _put_rows(acc, rows, self.opt.seq_axis, sub)

    def finish_lse(self, lse):
        return lse


class NumpyOps(_Ops):
    """float64 reference math (cuflash.reference) for the ring's algebra on the CPU."""

    def _zeros(self, shape):
        return np.zeros(shape)

    def _full(self, shape, value):
        return np.full(shape, value)

    def _bshd(self, x):  # (B, S, H, D) float64
        x = np.asarray(x, dtype=np.float64)
        return x.transpose(0, 2, 1, 3) if self.layout == "bhsd" else x

    def _out(self, x):
        return x.transpose(0, 2, 1, 3) if self.layout == "bhsd" else x

    def forward(self, q, k, v, block):
        from .. import reference
        if self.layout == "packed":
            return reference.attention_varlen_forward64(q, k, v, np.array(block.cu_q), np.array(block.cu_k),
                                                        block.causal, self.scale, softcap=self.softcap)
        o, lse = reference.attention_forward64(self._bshd(q), self._bshd(k), self._bshd(v), block.causal, self.scale,
                                               softcap=self.softcap)
        return self._out(o), lse

    def backward(self, do, q, k, v, o, lse, block):
        if self.layout != "packed":
            grads = self._backward_bshd(*(self._bshd(x) for x in (do, q, k, v, o)), np.asarray(lse), block.causal)
            return tuple(self._out(g) for g in grads)
        grads = [np.zeros(x.shape) for x in (q, k, v)]
        for i in range(len(block.cu_q) - 1):  # sequence by sequence, each a batch of one
            rq, rk = slice(block.cu_q[i], block.cu_q[i + 1]), slice(block.cu_k[i], block.cu_k[i + 1])
            g = self._backward_bshd(do[None, rq], q[None, rq], k[None, rk], v[None, rk], o[None, rq],
                                    np.asarray(lse)[None, :, rq], block.causal)
            grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        return tuple(grads)

    def _backward_bshd(self, do, q, k, v, o, lse, causal):
        """Gradients of one block with the global lse and O (not the block's own softmax), (B, S, H, D) arrays."""
        from .. import reference
        do, q, k, v, o = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v, o))
        heads_kv = k.shape[2]
        k, v = reference.repeat_kv(k, q.shape[2]), reference.repeat_kv(v, q.shape[2])
        s = np.einsum("bihd,bjhd->bhij", q, k) * self.scale
        t = None
        if self.softcap:
            t = np.tanh(s / self.softcap)
            s = self.softcap * t
        if causal:
            s = np.where(reference.causal_mask(q.shape[1], k.shape[1]), s, -np.inf)
        p = np.exp(s - lse[..., None])  # P = exp(S - lse), the global lse
        dv = np.einsum("bhij,bihd->bjhd", p, do)
        delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]  # D_i = rowsum(dO_i O_i), the global O
        ds = p * (np.einsum("bihd,bjhd->bhij", do, v) - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq = np.einsum("bhij,bjhd->bihd", ds, k) * self.scale
        dk = np.einsum("bhij,bihd->bjhd", ds, q) * self.scale
        return dq, reference.sum_kv_groups(dk, heads_kv), reference.sum_kv_groups(dv, heads_kv)

    def _merge(self, o_acc, lse_acc, o_b, lse_b):
        new = np.logaddexp(lse_acc, lse_b)
        with np.errstate(invalid="ignore"):  # rows no key reached yet: -inf - -inf; their weights are 0
            a = np.where(np.isneginf(new), 0.0, np.exp(lse_acc - new))
            b = np.where(np.isneginf(new), 0.0, np.exp(lse_b - new))
        o_acc[...] = o_acc * self._lse_as_rows(a) + np.asarray(o_b, np.float64) * self._lse_as_rows(b)
        lse_acc[...] = new

    def _accumulate(self, acc, part):
        acc += part

    def finish(self, acc):
        return acc


_KERNELS: dict = {}


def _load_expr(dtype: str) -> tuple[str, str]:
    """(CuPy parameter type, expression that widens `x` to the accumulator type) of an input dtype."""
    if dtype == "bf16":  # the bits of a bfloat16 are the top half of the float32 with the same value
        return "uint16", "__uint_as_float(((unsigned int)x) << 16)"
    return {"fp16": "float16", "fp32": "float32", "tf32": "float32", "fp64": "float64"}[dtype], "(A)x"


def _kernels(dtype: str):
    """The merge, accumulate and round-to-bf16 element-wise kernels for one input dtype (compiled once)."""
    if dtype not in _KERNELS:
        import cupy as cp

        ptype, load = _load_expr(dtype)
        acc = "float64" if dtype == "fp64" else "float32"
        merge = cp.ElementwiseKernel(
            f"{ptype} x, {acc} lse_b, {acc} lse_acc", f"{acc} o_acc",
            f"""
            typedef {'double' if acc == 'float64' else 'float'} A;
            // lse' = logaddexp(lse, lse_b); O = O e^(lse - lse') + O_b e^(lse_b - lse'), with m = max for range
            const A m = lse_acc > lse_b ? lse_acc : lse_b;
            if (!(isinf(m) && m < 0)) {{  // m == -inf: neither has seen a key yet, O stays 0 (not NaN)
                const A a = exp(lse_acc - m), b = exp(lse_b - m);
                o_acc = (o_acc * a + {load} * b) / (a + b);
            }}
            """, f"cuflash_ring_merge_{dtype}")
        accumulate = cp.ElementwiseKernel(
            f"{ptype} x", f"{acc} s", f"typedef {'double' if acc == 'float64' else 'float'} A; s += {load};",
            f"cuflash_ring_accumulate_{dtype}")
        to_bf16 = cp.ElementwiseKernel(  # float32 -> bfloat16 bits, round to nearest even (NaN stays NaN)
            "float32 x", "uint16 y",
            "const unsigned int u = __float_as_uint(x);"
            "y = isnan(x) ? (unsigned short)0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
            "cuflash_ring_to_bf16")
        _KERNELS[dtype] = merge, accumulate, to_bf16
    return _KERNELS[dtype]


class CupyOps(_Ops):
    """The kernels (cuflash.attention_forward / attention_backward and their varlen forms) and element-wise merges and
    sums, on the current stream."""

    def __init__(self, opt: RingOptions, scale: float, softcap, precision, deterministic: bool, dtype: str,
                 np_dtype):
        super().__init__(opt, scale, softcap)
        self.precision, self.deterministic = precision, deterministic
        self.dtype, self.np_dtype = dtype, np_dtype
        self.acc = np.float64 if dtype == "fp64" else np.float32
        self._cu = {}  # cumulative lengths (host tuple) -> int32 device array

    def _zeros(self, shape):
        import cupy as cp
        return cp.zeros(shape, self.acc)

    def _full(self, shape, value):
        import cupy as cp
        return cp.full(shape, value, self.acc)

    def _varlen(self, block):
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a packed block, the arrays made once."""
        import cupy as cp
        for cu in (block.cu_q, block.cu_k):
            if cu not in self._cu:
                self._cu[cu] = cp.asarray(np.array(cu, dtype=np.int32))
        longest = (lambda cu: int(np.diff(cu).max()) if len(cu) > 1 else 0)
        return self._cu[block.cu_q], self._cu[block.cu_k], longest(block.cu_q), longest(block.cu_k)

    def forward(self, q, k, v, block):
        from .. import api
        kw = dict(causal=block.causal, softmax_scale=self.scale, softcap=self.softcap, precision=self.precision)
        if self.layout == "packed":  # the ring built cu_seqlens itself: no host check of them per call
            return api.attention_varlen_forward(q, k, v, *self._varlen(block), check_inputs=False, **kw)
        return api.attention_forward(q, k, v, layout=self.layout, **kw)

    def backward(self, do, q, k, v, o, lse, block):
        from .. import api
        kw = dict(causal=block.causal, softmax_scale=self.scale, softcap=self.softcap, precision=self.precision,
                  deterministic=self.deterministic)
        if self.layout == "packed":
            return api.attention_varlen_backward(do, q, k, v, o, lse, *self._varlen(block), check_inputs=False, **kw)
        return api.attention_backward(do, q, k, v, o, lse, layout=self.layout, **kw)

    def _view(self, x):  # bf16 arrays enter the element-wise kernels as their bits
        import cupy as cp
        return x.view(cp.uint16) if self.dtype == "bf16" else x

    def _merge(self, o_acc, lse_acc, o_b, lse_b):
        import cupy as cp
        lse_b = lse_b.astype(self.acc, copy=False)
        _kernels(self.dtype)[0](self._view(o_b), self._lse_as_rows(lse_b), self._lse_as_rows(lse_acc), o_acc)
        cp.logaddexp(lse_acc, lse_b, out=lse_acc)

    def _accumulate(self, acc, part):
        _kernels(self.dtype)[1](self._view(part), acc)

    def finish(self, acc):
        import cupy as cp
        if self.dtype == "bf16":
            return _kernels(self.dtype)[2](acc).view(self.np_dtype)
        if self.dtype == "fp16":
            return acc.astype(cp.float16)
        return acc  # float32 / float64 sums are the outputs
