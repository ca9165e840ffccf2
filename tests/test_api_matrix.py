"""Every public entry point over dtypes x head dims x score modifiers, on every GPU target and kernel setting, on CPU:
CuPy's allocation and the driver launch are faked (tools/fake_cupy.py) and the device's target is patched.

The spec: a call either launches kernels or is refused with a TypeError / ValueError before anything is allocated or
launched, with a message of its own; never an internal error (an exception of another type, or config.select's "no
kernel family runs ..." reaching the user), and never a refusal after the call has allocated its outputs. The FP8
forward broke this on every GPU but Hopper and with CUFLASH_KERNELS=mma (it allocated o and lse, then failed in
config.select).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _launch, config

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if not (TOOLS / "fake_cupy.py").exists():  # pragma: no cover - an installed cuflash without tools/
    pytest.skip("tools/ is not part of this installation", allow_module_level=True)
sys.path.insert(0, str(TOOLS))
import fake_cupy as fc  # noqa: E402

A = fc.FakeArray
DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32, "tf32": np.float32, "fp64": np.float64,
          "fp8": np.uint8}
HEAD_DIMS = (32, 40, 64, 96, 128, 192, 256)
B, SQ, SK, H = 2, 40, 300, 4
ALLOCATING = ("launch", "empty", "zeros", "full", "copy", "fill", "logical_and", "arange")


def modifiers(name: str, packed: bool = False) -> dict:
    rows = () if packed else (B,)
    return {"none": {}, "causal": {"causal": True}, "window": {"window": (16, 8)},
            "alibi": {"alibi_slopes": A((H,), np.float32)}, "softcap": {"softcap": 30.0},
            "dropout": {"dropout_p": 0.1, "seed": 0},
            "bias": {"bias": A((*rows, H, SQ, SK), np.float32)}, "mask": {"mask": A((*rows, 1, SQ, SK), np.bool_)},
            "key_padding_mask": {"key_padding_mask": A((B, SK), np.bool_)},
            "blockmask": {"mask": fc.block_mask((B, 1, SQ, SK), True)},
            "all": {"causal": True, "alibi_slopes": A((H,), np.float32), "softcap": 30.0, "dropout_p": 0.1,
                    "seed": 0}}[name]


DENSE_MODS = ("none", "causal", "window", "alibi", "softcap", "dropout", "bias", "mask", "key_padding_mask",
              "blockmask", "all")
PACKED_MODS = ("none", "causal", "window", "alibi", "softcap", "dropout", "all")


def dense_call(dtype: str, d: int, mods: str, op: str):
    t = DTYPES[dtype]
    q, k, v = A((B, SQ, H, d), t), A((B, SK, H, d), t), A((B, SK, H, d), t)
    kw = dict(modifiers(mods))
    if dtype in ("fp32", "tf32"):
        kw["precision"] = dtype
    if op == "forward":
        return lambda: cuflash.attention_forward(q, k, v, **kw)
    o = A((B, SQ, H, d), ml_dtypes.bfloat16 if dtype == "fp8" else t)
    lse = A((B, H, SQ), np.float64 if dtype == "fp64" else np.float32)
    return lambda: cuflash.attention_backward(o, q, k, v, o, lse, deterministic=op == "backward-deterministic", **kw)


def packed_call(dtype: str, d: int, mods: str, op: str):
    t = DTYPES[dtype]
    q, k, v = A((B * SQ, H, d), t), A((B * SK, H, d), t), A((B * SK, H, d), t)
    cu_q, cu_k = A((B + 1,), np.int32), A((B + 1,), np.int32)
    kw = dict(modifiers(mods, packed=True), check_inputs=False)
    if dtype in ("fp32", "tf32"):
        kw["precision"] = dtype
    if op == "forward":
        return lambda: cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, SQ, SK, **kw)
    o = A((B * SQ, H, d), ml_dtypes.bfloat16 if dtype == "fp8" else t)
    lse = A((H, B * SQ), np.float64 if dtype == "fp64" else np.float32)
    return lambda: cuflash.attention_varlen_backward(o, q, k, v, o, lse, cu_q, cu_k, SQ, SK,
                                                     deterministic=op == "backward-deterministic", **kw)


def decode_call(dtype: str, d: int, mods: str, op: str):
    t = DTYPES[dtype]
    kw = {"none": {}, "causal": {"causal": True}, "window": {"window": (64, 0)},
          "alibi": {"alibi_slopes": A((H,), np.float32)}, "softcap": {"softcap": 30.0}}[mods]
    q, kc, vc = A((B, 1, H, d), t), A((B, SK, 2, d), t), A((B, SK, 2, d), t)
    k, v = A((B, 1, 2, d), t), A((B, 1, 2, d), t)
    lens = A((B,), np.int32)
    return lambda: cuflash.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, check_inputs=False, **kw)


def cases():
    ops = ("forward", "backward", "backward-deterministic")
    for dtype, d, mods, op in itertools.product(DTYPES, HEAD_DIMS, DENSE_MODS, ops):
        yield f"{op}-{dtype}-d{d}-{mods}", dense_call(dtype, d, mods, op)
    for dtype, d, mods, op in itertools.product(DTYPES, HEAD_DIMS, PACKED_MODS, ops):
        yield f"varlen-{op}-{dtype}-d{d}-{mods}", packed_call(dtype, d, mods, op)
    for dtype, d, mods in itertools.product(DTYPES, HEAD_DIMS, ("none", "causal", "window", "alibi", "softcap")):
        yield f"kvcache-{dtype}-d{d}-{mods}", decode_call(dtype, d, mods, "decode")


def outcome(call) -> tuple[str, str]:
    """("launched" | "refused" | "bad", what): bad is an exception of another type, an internal message, or a
    refusal after something was allocated or launched."""
    fc.COUNTS.clear()
    try:
        call()
    except (TypeError, ValueError) as e:
        used = {n: fc.COUNTS[n] for n in ALLOCATING if fc.COUNTS[n]}
        if "no kernel family runs" in str(e) or used:
            return "bad", f"{type(e).__name__} after {used or 'nothing'}: {e}"
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 - what the test looks for
        return "bad", f"{type(e).__name__}: {e}"
    return ("launched" if fc.COUNTS["launch"] else "bad"), "" if fc.COUNTS["launch"] else "returned, launched nothing"


@pytest.fixture
def fake_gpu(monkeypatch):
    fc.install(monkeypatch.setattr)
    fc.COUNTS.clear()


TARGETS = [("sm_80", "auto"), ("sm_86", "auto"), ("sm_89", "auto"), ("sm_90a", "auto"), ("sm_90a", "mma")]


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("arch,kernels", TARGETS, ids=[f"{a}-{k}" for a, k in TARGETS])
def test_every_call_launches_or_is_refused_before_allocating(monkeypatch, arch, kernels):
    monkeypatch.setattr(_launch, "device_arch", lambda device: arch)
    monkeypatch.setattr(config, "KERNELS", kernels)
    results = {name: outcome(call) for name, call in cases()}
    bad = {name: what for name, (kind, what) in results.items() if kind == "bad"}
    assert not bad, f"{len(bad)} calls neither launched nor were refused cleanly, e.g. {list(bad.items())[:5]}"
    launched = {name for name, (kind, _) in results.items() if kind == "launched"}
    # the matrix is not vacuous: the plain calls of every dtype run everywhere, FP8 on Hopper's kernels only
    for name in ("forward-fp16-d64-none", "backward-bf16-d128-causal", "forward-fp32-d64-none",
                 "backward-deterministic-fp64-d64-none", "varlen-backward-tf32-d128-window", "kvcache-bf16-d128-none"):
        assert name in launched, (name, results[name])
    fp8 = results["forward-fp8-d128-causal"]
    if config.uses_wgmma(arch, kernels):
        assert fp8[0] == "launched", fp8
    else:
        assert fp8[0] == "refused" and "q.dtype=uint8" in fp8[1], fp8
