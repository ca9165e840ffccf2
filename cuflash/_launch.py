"""Kernel loading and launching: compiled cubins become CuPy modules, arguments a ctypes struct.

Launches go through `cupy.cuda.driver.launchKernel` with one by-value struct argument mirroring the
C++ params struct; a compiled function is cached per (device, instantiation), so a warm call costs a
dictionary lookup, a struct fill and the driver call.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from functools import cached_property, lru_cache

from . import _compile

_c_ll = ctypes.c_longlong
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
LOG2E = 1.4426950408889634


class SeqParams(ctypes.Structure):
    """Mirror of cuflash::SeqParams (cuda/seqs.cuh): dense or packed (varlen) sequences, GQA group size."""

    _fields_ = [
        ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p), ("seqused_k", ctypes.c_void_p),
        ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int), ("kv_group", ctypes.c_int),
        ("seqlen_k_new", ctypes.c_int),
    ]


def seq_params(seqlen_q: int, seqlen_k: int, kv_group: int = 1, cu_seqlens_q=None, cu_seqlens_k=None,
               seqused_k=None, seqlen_k_new: int = 0) -> SeqParams:
    """SeqParams for dense sequences (the cu_seqlens / seqused_k pointers None), packed ones, or a kv cache
    (seqused_k: keys cached per sequence, or None: seqlen_k each; plus seqlen_k_new appended keys)."""
    return SeqParams(cu_seqlens_q, cu_seqlens_k, seqused_k, seqlen_q, seqlen_k, kv_group, seqlen_k_new)


class Broadcast(ctypes.Structure):
    """Mirror of cuflash::Broadcast (cuda/mods.cuh): an array broadcast to (batch, heads, seqlen_q, seqlen_k). A
    divisor whose dim is read with stride 0 is stored as 1 (the quotient is multiplied by 0): the kernels skip the
    division where it is 1 (cuda/mods.cuh broadcast_div), and compute these offsets at every step."""

    _fields_ = [("ptr", ctypes.c_void_p), ("stride_b", _c_ll), ("stride_h", _c_ll), ("stride_q", ctypes.c_int),
                ("stride_k", ctypes.c_int), ("batch_div", ctypes.c_int), ("head_div", ctypes.c_int)]

    def __init__(self, ptr=None, stride_b=0, stride_h=0, stride_q=0, stride_k=0, batch_div=1, head_div=1):
        super().__init__(ptr, stride_b, stride_h, stride_q, stride_k, batch_div if stride_b else 1,
                         head_div if stride_h else 1)


class ModParams(ctypes.Structure):
    """Mirror of cuflash::ModParams (cuda/mods.cuh): the score modifiers' run-time values."""

    _fields_ = [
        ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", _c_ll), ("seed", ctypes.c_uint64),
        ("window_left", ctypes.c_int), ("window_right", ctypes.c_int), ("softcap_pre", ctypes.c_float),
        ("softcap_post", ctypes.c_float), ("alibi_scale", ctypes.c_float), ("dropout_offset", ctypes.c_uint32),
        ("dropout_threshold", ctypes.c_uint32), ("dropout_rp", ctypes.c_float),
        ("bias", Broadcast), ("mask", Broadcast), ("dbias", Broadcast), ("block_map", Broadcast),
        ("bias_kind", ctypes.c_int),
        ("dbias_atomic", ctypes.c_int),
    ]


class FwdParams(ctypes.Structure):
    """Mirror of cuflash::FwdParams (cuda/fwd.cuh); field order and types must match."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("seq", SeqParams),
        ("block_table", ctypes.c_void_p), ("o_accum", ctypes.c_void_p), ("lse_accum", ctypes.c_void_p),
        ("split_counters", ctypes.c_void_p),
        ("q_batch_stride", _c_ll), ("q_row_stride", _c_ll), ("q_head_stride", _c_ll),
        ("k_batch_stride", _c_ll), ("k_row_stride", _c_ll), ("k_head_stride", _c_ll),
        ("v_batch_stride", _c_ll), ("v_row_stride", _c_ll), ("v_head_stride", _c_ll),
        ("o_batch_stride", _c_ll), ("o_row_stride", _c_ll), ("o_head_stride", _c_ll),
        ("lse_batch_stride", _c_ll), ("lse_head_stride", _c_ll),
        ("k_page_stride", _c_ll), ("v_page_stride", _c_ll),
        ("heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("block_table_stride", ctypes.c_int),
        ("page_size", ctypes.c_int), ("num_splits", ctypes.c_int), ("rows_per_pos", ctypes.c_int),
        ("scale_log2", ctypes.c_float), ("accum_cols", ctypes.c_int), ("mods", ModParams),
        ("scale_log2_d", ctypes.c_double), ("cache_batch_idx", ctypes.c_void_p), ("leftpad_k", ctypes.c_void_p),
    ]


class DropoutMaskParams(ctypes.Structure):
    """Mirror of cuflash::DropoutMaskParams (cuda/mods.cuh)."""

    _fields_ = [("mask", ctypes.c_void_p), ("mods", ModParams), ("seqlen_q", ctypes.c_int),
                ("seqlen_k", ctypes.c_int), ("heads", ctypes.c_int)]


class PaddingTilesParams(ctypes.Structure):
    """Mirror of cuflash::PaddingTilesParams (cuda/mods.cuh)."""

    _fields_ = [("mask", ctypes.c_void_p), ("states", ctypes.c_void_p), ("stride_b", _c_ll), ("stride_k", _c_ll),
                ("rows", ctypes.c_int), ("seqlen_k", ctypes.c_int), ("block_n", ctypes.c_int), ("tiles", ctypes.c_int)]


class BwdParams(ctypes.Structure):
    """Mirror of cuflash::BwdParams (cuda/bwd.cuh); field order and types must match."""

    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse", "dq_accum", "lse_log2",
                                       "delta")]
        + [("seq", SeqParams)]
        + [(f"{a}_{s}_stride", _c_ll) for a in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
           for s in ("batch", "row", "head")]
        + [("lse_batch_stride", _c_ll), ("lse_head_stride", _c_ll), ("lse_row_stride", _c_ll)]
        + [(n, ctypes.c_int) for n in ("seqlen_q_pad", "heads", "head_dim", "dq_accum_cols")]
        + [("scale_log2", ctypes.c_float), ("softmax_scale", ctypes.c_float), ("mods", ModParams)]
        + [("scale_log2_d", ctypes.c_double), ("softmax_scale_d", ctypes.c_double)]
        + [("dq_turns", ctypes.c_void_p)]
    )


class AppendParams(ctypes.Structure):
    """Mirror of cuflash::AppendParams (cuda/kvcache.cuh)."""

    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table")]
        + [(f"{a}_{s}_stride", _c_ll) for a in ("kn", "vn", "kc", "vc") for s in ("batch", "row", "head")]
        + [(n, ctypes.c_int) for n in ("cache_seqlen", "s_new", "kv_heads", "head_dim", "page_size",
                                      "block_table_stride")]
        + [(n, ctypes.c_void_p) for n in ("cache_batch_idx", "rotary_cos", "rotary_sin", "q", "q_rot")]
        + [(f"q_{s}_stride", _c_ll) for s in ("batch", "row", "head")] + [("rotary_row_stride", _c_ll)]
        + [(n, ctypes.c_int) for n in ("rotary_dim", "rotary_interleaved", "rotary_kind", "seqlen_q", "heads_q",
                                      "q_pos_step")]
    )


# The C++ side static_asserts the same sizes: a field added on one side only fails loudly on both.
assert ctypes.sizeof(ModParams) == 224 and ctypes.sizeof(SeqParams) == 40 and ctypes.sizeof(FwdParams) == 520 and ctypes.sizeof(BwdParams) == 624
assert ctypes.sizeof(AppendParams) == 264 and ctypes.sizeof(DropoutMaskParams) == 248
assert ctypes.sizeof(PaddingTilesParams) == 48


class _Kernel:
    """A loaded kernel: its module (kept alive), function and launch shape."""

    def __init__(self, compiled: _compile.Compiled, threads: int, smem_bytes: int):
        from cupy.cuda import driver, function

        self.module = function.Module()
        self.module.load(compiled.cubin)
        self.function = self.module.get_function(compiled.lowered_name)
        self.threads = threads
        self.smem_bytes = smem_bytes
        if smem_bytes > 48 * 1024:
            driver.funcSetAttribute(self.function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes)

    @cached_property
    def ctas_per_sm(self) -> int:
        """How many CTAs of this kernel one SM holds at once (registers, shared memory, threads)."""
        from cupy.cuda import driver

        return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(self.function.ptr, self.threads,
                                                                          self.smem_bytes))

    def at_most(self, ctas_per_sm: int, device_id: int) -> _Kernel:
        """This kernel launched so that one SM holds at most `ctas_per_sm` of its CTAs: itself when its registers,
        shared memory and threads already allow no more, else a sibling (the same function) whose launches ask for
        more dynamic shared memory than they use (capped_smem_bytes), made once per cap."""
        siblings = self.__dict__.setdefault("_at_most", {})
        kernel = siblings.get(ctas_per_sm)
        if kernel is None:
            kernel = self
            if self.ctas_per_sm > ctas_per_sm:
                from cupy.cuda import driver

                smem = capped_smem_bytes(self.smem_bytes, ctas_per_sm, smem_per_sm(device_id),
                                         reserved_smem_per_cta(device_id))
                kernel = object.__new__(_Kernel)
                kernel.module, kernel.function, kernel.threads, kernel.smem_bytes = (
                    self.module, self.function, self.threads, smem)
                if smem > max(48 * 1024, self.smem_bytes):
                    driver.funcSetAttribute(self.function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                if kernel.ctas_per_sm > ctas_per_sm:  # the driver's own count: the padding must have worked
                    raise RuntimeError(f"{ctas_per_sm} CTAs per SM asked for, {kernel.ctas_per_sm} fit with {smem} "
                                       f"bytes of shared memory each")
            siblings[ctas_per_sm] = kernel
        return kernel

    def launch(self, grid, params: ctypes.Structure, stream_ptr: int) -> None:
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        _driver().launchKernel(self.function.ptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem_bytes,
                               stream_ptr, ctypes.addressof(args), 0)

    def launch_at(self, grid, args_address: int, stream_ptr: int) -> None:
        """Launch with the argument block (kernelParams array, then the struct) at this address
        (`ArgsTemplate.mine`)."""
        _driver().launchKernel(self.function.ptr, grid[0], grid[1], grid[2], self.threads, 1, 1, self.smem_bytes,
                               stream_ptr, args_address, 0)


_driver_module = None


def _driver():
    """cupy.cuda.driver, imported once (a `from ... import` on every launch costs about half a microsecond)."""
    global _driver_module
    if _driver_module is None:
        from cupy.cuda import driver

        _driver_module = driver
    return _driver_module


@lru_cache(maxsize=None)
def _args_type(params_type):
    """ctypes struct of a launch's whole argument block: `void* kernelParams[1]` followed by the params struct
    it points at, so that one copy of a template and one pointer write make the block of a call."""
    return type(f"{params_type.__name__}Args", (ctypes.Structure,),
                {"_fields_": [("arg", ctypes.c_void_p), ("params", params_type)]})


class ArgsTemplate:
    """The launch arguments of a call signature (a plan), recorded once from a complete params struct.

    A warm call takes its thread's block (`mine()`, a copy of the template made on the thread's first call)
    and completes its params with what changes per call (the array addresses); the template itself is never
    written and threads never share a block, so calls of one plan may run at the same time in several threads
    (or be captured into a CUDA graph, which copies the arguments at the launch)."""

    __slots__ = ("type", "bytes", "offset", "_mine")

    def __init__(self, params: ctypes.Structure):
        self.type = _args_type(type(params))
        block = self.type()
        block.params = params
        self.bytes = bytes(block)
        self.offset = self.type.params.offset
        self._mine: dict = {}  # thread ident -> (block, its params, its address): the dict keeps the block alive

    def new(self) -> ctypes.Structure:
        """A fresh argument block (`.params` to complete) whose kernelParams entry points at its own struct."""
        block = self.type.from_buffer_copy(self.bytes)
        block.arg = ctypes.addressof(block) + self.offset
        return block

    def mine(self) -> tuple:
        """(params, address of the whole block, its 8-byte words) of the calling thread's argument block, for a
        warm call's launch (`words[field_word(...)] = address` sets a pointer field).

        Made by `new()` on the thread's first call and reused by its later ones: cuLaunchKernel has read the
        arguments when it returns (a graph capture copies them too), so the block is free again after each
        launch, and the thread's next call sets every field that changes per call. A fresh block per call
        costs a template copy and two ctypes views, ~0.7 us of a ~10 us call. Threads never share a block."""
        ident = threading.get_ident()
        entry = self._mine.get(ident)
        if entry is None:
            if len(self._mine) >= 64:  # idents of finished threads: forget them all (blocks are cheap to make)
                self._mine = {}
            block = self.new()
            entry = self._mine[ident] = (block, block.params, ctypes.addressof(block),
                                         memoryview(block).cast("B").cast("Q"))
        return entry[1:]


def field_span(params_type, path: str) -> tuple:
    """(first word, words) of a field (e.g. "seq.seqused_k") among the 8-byte words of an argument block of
    params_type (`ArgsTemplate.mine`): the block's kernelParams pointer is word 0, the struct follows it."""
    offset = _args_type(params_type).params.offset
    struct = params_type
    for name in path.split("."):
        field = getattr(struct, name)
        offset += field.offset
        struct = dict(struct._fields_)[name]
    size = ctypes.sizeof(struct)
    if offset % 8 or size % 8:
        raise ValueError(f"{params_type.__name__}.{path} is not a whole number of aligned 8-byte words")
    return offset // 8, size // 8


def field_word(params_type, path: str) -> int:
    """Index of a pointer field among the 8-byte words of an argument block of params_type (`field_span`)."""
    word, n = field_span(params_type, path)
    if n != 1:
        raise ValueError(f"{params_type.__name__}.{path} is not an 8-byte field")
    return word


_cupy_module = None


def cupy():
    """The cupy module, imported on first use (import cuflash works without it; tests put a fake here)."""
    global _cupy_module
    if _cupy_module is None:
        import cupy as cp

        _cupy_module = cp
    return _cupy_module


_NO_SWITCH = contextlib.nullcontext()


def on_device(cp, device: int):
    """`with cupy.cuda.Device(device)`, skipped when it is already the current device (saves ~2 us)."""
    return _NO_SWITCH if cp.cuda.runtime.getDevice() == device else cp.cuda.Device(device)


_kernels: dict = {}
_lock = threading.Lock()


@lru_cache(maxsize=None)
def device_arch(device_id: int) -> str:
    """NVRTC target of a device ("sm_90a" on an H100), looked up once per device."""
    return _compile.device_arch(device_id)


def capped_smem_bytes(smem_bytes: int, ctas_per_sm: int, smem_per_sm: int, reserved_per_cta: int) -> int:
    """Dynamic shared memory to launch a kernel of `smem_bytes` with, so that an SM of `smem_per_sm` bytes (of which
    each CTA also takes `reserved_per_cta`) holds at most `ctas_per_sm` of its CTAs: the least that leaves no room
    for one more, or smem_bytes if that is already more. ValueError if not even `ctas_per_sm` would fit."""
    if ctas_per_sm < 1 or (smem_bytes + reserved_per_cta) * ctas_per_sm > smem_per_sm:
        raise ValueError(f"ctas_per_sm={ctas_per_sm} CTAs of {smem_bytes} bytes (+{reserved_per_cta} reserved) do "
                         f"not fit {smem_per_sm} bytes of shared memory per SM")
    return max(smem_bytes, smem_per_sm // (ctas_per_sm + 1) - reserved_per_cta + 1)


@lru_cache(maxsize=None)
def smem_per_sm(device_id: int) -> int:
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id)


_CUDA_DEV_ATTR_RESERVED_SHARED_MEMORY_PER_BLOCK = 111  # cudaDevAttrReservedSharedMemoryPerBlock


@lru_cache(maxsize=None)
def reserved_smem_per_cta(device_id: int) -> int:
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(_CUDA_DEV_ATTR_RESERVED_SHARED_MEMORY_PER_BLOCK, device_id)


@lru_cache(maxsize=None)
def max_smem_optin(device_id: int) -> int:
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)


def get_kernel(cfg, device_id: int) -> _Kernel:
    """The loaded kernel of a config (FwdConfig, BwdConfig, ...) on a device; compiles on first use."""
    key = (device_id, cfg)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:  # one thread compiles; the others wait for it instead of compiling again
            kernel = _kernels.get(key)
            if kernel is None:
                if cfg.smem_bytes > max_smem_optin(device_id):
                    raise RuntimeError(
                        f"{cfg.cpp_name()} needs {cfg.smem_bytes} bytes of shared memory per CTA but device "
                        f"{device_id} allows {max_smem_optin(device_id)}: cuflash's tiles are chosen for A100/H100-class "
                        f"GPUs (sm_80, sm_90) with >= 164 KB per CTA")
                compiled = _compile.compile_kernel(cfg.cpp_name(), device_arch(device_id))
                kernel = _kernels[key] = _Kernel(compiled, cfg.threads, cfg.smem_bytes)
    return kernel


def scale_log2(softmax_scale: float) -> float:
    return softmax_scale * LOG2E


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
