"""A stand-in for the few CuPy entry points a warm cuflash call uses, so its host path runs without a GPU.

`install(monkeypatch_setattr)` makes cuflash accept `FakeArray` as a CuPy array and replaces allocation,
device and stream queries, kernel lookup and the driver launch with cheap fakes that count their calls
(`COUNTS`). Used by `tools/launch_overhead.py --fake` (time the pure-Python host path per call) and by the
CPU tests of the plan cache (tests/test_plan_cache.py). The fakes do no work, so timings taken with them are
the Python cost of cuflash alone; a real call adds CuPy's allocation, stream lookup and cuLaunchKernel.
"""
from __future__ import annotations

import collections
import math
import types

import numpy as np

from cuflash import _families, _fp8, _launch, _plan, _tma, _validate

COUNTS: collections.Counter = collections.Counter()  # what the fakes were asked to do, by name
LAUNCHES: list = []  # (kernel name, grid, params bytes) of each launch while RECORD[0] is True
RECORD = [False]


class FakeMemoryPointer:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id


class FakeDevice:
    """cupy.cuda.Device: `.id`, and a context manager that counts the switches."""

    def __init__(self, device_id: int = 0):
        self.id = device_id

    def __enter__(self):
        COUNTS["device switch"] += 1
        return self

    def __exit__(self, *exc):
        return False


_contiguous: dict = {}  # (shape, dtype) -> C-contiguous byte strides


class FakeArray:
    """Metadata of a CuPy array (shape, byte strides, dtype, address, device) and no data."""

    __slots__ = ("shape", "dtype", "strides", "size", "data", "host")
    _next = 1 << 32

    def __init__(self, shape, dtype=np.float16, strides=None, ptr=None, device=0):
        self.shape = shape = tuple(shape)
        self.dtype = dtype = np.dtype(dtype)
        if strides is None:  # C-contiguous, in bytes
            strides = _contiguous.get((shape, dtype))
            if strides is None:
                strides, step = [], dtype.itemsize
                for n in reversed(shape):
                    strides.append(step)
                    step *= max(n, 1)
                strides = _contiguous[shape, dtype] = tuple(reversed(strides))
        self.strides = tuple(strides)
        self.size = math.prod(shape)
        if ptr is None:
            FakeArray._next += 1 << 24  # distinct, 256-byte aligned addresses
            ptr = FakeArray._next
        self.data = FakeMemoryPointer(ptr, device)

    @property
    def device(self):
        return FakeDevice(self.data.device_id)

    def copy(self):
        COUNTS["copy"] += 1
        return FakeArray(self.shape, self.dtype, device=self.data.device_id)

    def fill(self, value):
        COUNTS["fill"] += 1

    def __getitem__(self, index):  # views at the same address (enough for q[:, :1]-style test inputs)
        if type(index) is FakeArray:  # rows picked by an index array: a new array
            COUNTS["take"] += 1
            return FakeArray(index.shape + self.shape[1:], self.dtype, device=self.data.device_id)
        return FakeArray(np.empty(self.shape, dtype=np.uint8)[index].shape, self.dtype, self.strides,
                         self.data.ptr, self.data.device_id)

    def reshape(self, *shape):  # a view at the same address, with C-contiguous strides
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return FakeArray(np.empty(self.shape, dtype=np.uint8).reshape(shape).shape, self.dtype, None, self.data.ptr,
                         self.data.device_id)

    def __floordiv__(self, other):
        return FakeArray(self.shape, self.dtype, device=self.data.device_id)


def _empty(shape, dtype=np.float32):
    COUNTS["empty"] += 1
    return FakeArray(shape if isinstance(shape, tuple) else (shape,), dtype)


def _full(shape, value, dtype=np.float32):
    COUNTS["full"] += 1
    return FakeArray(shape, dtype)


def _zeros(shape, dtype=np.float32):
    COUNTS["zeros"] += 1
    return FakeArray(shape if isinstance(shape, tuple) else (shape,), dtype)


def _arange(n, dtype=np.int64):
    COUNTS["arange"] += 1
    return FakeArray((n,), dtype)


def _logical_and(x, y):
    COUNTS["logical_and"] += 1
    return FakeArray(np.broadcast_shapes(x.shape, y.shape), np.bool_, device=x.data.device_id)


def block_mask(shape, aligned: bool):
    """A cuflash.BlockMask over a FakeArray bool mask of `shape` whose tile maps are FakeArrays (one per tile shape,
    kept, as the real ones are) and whose tiles are all empty or full (`aligned`) or not."""
    import cuflash

    bm = cuflash.BlockMask(FakeArray(shape, np.bool_))
    maps = {}

    def tile_map(block_m, block_n, sq, sk, transposed=False):
        key = (block_m, block_n, sq, sk, transposed)
        if key not in maps:
            nm, nn = -(-sq // block_m), -(-sk // block_n)
            maps[key] = FakeArray((*shape[:-2], nn, nm) if transposed else (*shape[:-2], nm, nn), np.uint8)
        return maps[key]

    bm.tile_map = tile_map
    bm.aligned = lambda *args: aligned
    # every tile visited (what the backward's choice of step size counts)
    bm.tiles_visited = lambda block_m, block_n, sq, sk: math.prod(shape[:-2]) * -(-sq // block_m) * -(-sk // block_n)
    return bm


def _asnumpy(x):
    COUNTS["asnumpy"] += 1
    return getattr(x, "host", np.zeros(x.shape, x.dtype))


class _Stream:
    ptr = 0


def _get_current_stream():
    COUNTS["get_current_stream"] += 1
    return _Stream


def _get_device():
    COUNTS["getDevice"] += 1
    return 0


def _launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
    COUNTS["launch"] += 1
    if RECORD[0]:
        import ctypes

        params = ctypes.c_void_p.from_address(kernel_params).value
        size = _SIZES.get(func, 0)
        LAUNCHES.append((_NAMES.get(func), (gx, gy, gz), ctypes.string_at(params, size)))


cupy = types.SimpleNamespace(
    empty=_empty, zeros=_zeros, full=_full, asnumpy=_asnumpy, arange=_arange, logical_and=_logical_and,
    float32=np.float32, float64=np.float64, int32=np.int32, uint8=np.uint8, bool_=np.bool_, inf=np.inf,
    ndarray=FakeArray,
    cuda=types.SimpleNamespace(Device=FakeDevice, get_current_stream=_get_current_stream,
                               runtime=types.SimpleNamespace(getDevice=_get_device)))
_NAMES: dict = {}
_SIZES: dict = {}
_kernels: dict = {}


def _fake_kernel(cfg, device_id):
    """A `_launch._Kernel` for cfg without a module: launch() reaches the fake driver call."""
    key = (device_id, cfg)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _launch._Kernel.__new__(_launch._Kernel)
        kernel.threads, kernel.smem_bytes = cfg.threads, cfg.smem_bytes
        kernel.__dict__["ctas_per_sm"] = 2
        kernel.function = types.SimpleNamespace(ptr=1000 + len(_kernels))
        _NAMES[kernel.function.ptr] = cfg.cpp_name()
        _SIZES[kernel.function.ptr] = ctypes_size(cfg)
        _kernels[key] = kernel
    return kernel


def ctypes_size(cfg) -> int:
    """Bytes of the params struct a kernel of cfg takes (to record what a launch passed)."""
    import ctypes

    name = cfg.cpp_name()
    if "fwd_sm90_fp8" in name:
        return ctypes.sizeof(_tma.FwdFp8Params)
    if "fwd_sm90_ws" in name or "fwd_sm90_tf32" in name:
        return ctypes.sizeof(_tma.FwdWsParams)
    if "bwd_sm90_ws_kernel" in name or "bwd_sm90_split_kernel" in name or "sm90_tf32_kernel<cuflash::Bwd" in name:
        return ctypes.sizeof(_tma.BwdWsParams)
    if "append" in name:
        return ctypes.sizeof(_launch.AppendParams)
    if "padding_tiles" in name:
        return ctypes.sizeof(_launch.PaddingTilesParams)
    if "bwd" in name or "preprocess" in name or "convert_dq" in name or "dq_kernel" in name:
        return ctypes.sizeof(_launch.BwdParams)
    return ctypes.sizeof(_launch.FwdParams)


def _encode_tiled(map_addr, dtype, rank, address, dims, strides, box, elem_strides, interleave, swizzle, l2, oob):
    """Stands in for the driver's cuTensorMapEncodeTiled: a map of the words it was given (address first), so a
    launch's bytes show which address and shape each map describes."""
    import ctypes

    COUNTS["encode"] += 1
    words = [address, dtype, rank, *dims[:rank], *strides[:rank - 1], *box[:rank], swizzle]
    ctypes.memmove(map_addr, (ctypes.c_uint64 * 16)(*words[:16]), 128)
    return 0


def install(setattr_) -> None:
    """Patch cuflash (and cupy.cuda.driver.launchKernel) through `setattr_(obj, name, value)`, e.g.
    pytest's monkeypatch.setattr, or plain setattr in a script."""
    from cupy.cuda import driver

    setattr_(_validate, "_ndarray", FakeArray)
    setattr_(_launch, "cupy", lambda: cupy)
    setattr_(_launch, "get_kernel", _fake_kernel)
    setattr_(_launch, "device_arch", lambda device_id: "sm_90a")
    setattr_(_fp8, "is_fp8", lambda x: type(x) is FakeArray and x.dtype == np.uint8)  # as a CuPy uint8 array
    setattr_(driver, "launchKernel", _launch_kernel)
    setattr_(_families, "_num_sms", {0: 132})
    setattr_(_families, "_selected", {})
    setattr_(_plan, "plans", _plan.PlanCache())
    setattr_(_tma, "_encode_fn", lambda: _encode_tiled)
