"""Execute mode: each strategy's tile schedule in float64 equals cuflash.reference (docs/IO_ANALYSIS.md)."""
import math

import numpy as np
import pytest

from cuflash.reference import attention_backward64, attention_forward64
from cuflash.simulator import execute_backward, execute_forward

# blocks that leave tails in both sequence lengths and (fa1) in the head dim
STRATEGIES = [
    ("standard", {}),
    ("fa1", {"sram_bytes": 16 * 1024}),  # d=40: B_c = ceil(8192 / 160) = 52, B_r = 40
    ("fa2", {"block_m": 64, "block_n": 32}),
    ("cuflash", {}),  # tiles from cuflash.config (the wgmma kernels'), head_dim padded to the kernel's
    ("cuflash", {"kernels": "mma"}),  # the mma.sync kernels' tiles
]
IDS = ["standard", "fa1", "fa2", "cuflash", "cuflash-mma"]
SHAPES = [(113, 203), (203, 113), (1, 239), (300, 517), (128, 128)]
TOL = 1e-10


def _inputs(sq, sk, d=40, b=2, h=2, seed=0):
    rng = np.random.default_rng(seed + 1000 * sq + sk)
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, h, d)),
            rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sq, h, d)))


def _check_grads(do, q, k, v, grads, causal, window):
    """dq, dk, dv of a schedule against the float64 reference (TOL)."""
    ref = attention_backward64(do, q, k, v, causal, window=window)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref[:3]):
        err = np.abs(got - want).max()
        assert err < TOL, f"{name} mismatch sq={q.shape[1]} sk={k.shape[1]} causal={causal} window={window}: {err:.2e}"


@pytest.mark.parametrize("strategy,kw", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_schedule_equals_reference(strategy, kw, sq, sk, causal):
    q, k, v, _ = _inputs(sq, sk)
    o, lse = execute_forward(strategy, q, k, v, causal=causal, **kw)
    o_ref, lse_ref = attention_forward64(q, k, v, causal)
    err = np.abs(o - o_ref).max()
    assert err < TOL, f"o mismatch for {strategy} sq={sq} sk={sk} causal={causal}: {err:.2e}"
    seen = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == seen).all(), f"rows that see no key must have lse = -inf ({strategy})"
    if seen.any():
        err = np.abs(lse[seen] - lse_ref[seen]).max()
        assert err < TOL, f"lse mismatch for {strategy} sq={sq} sk={sk} causal={causal}: {err:.2e}"


@pytest.mark.parametrize("strategy,kw", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_schedule_equals_reference(strategy, kw, sq, sk, causal):
    q, k, v, do = _inputs(sq, sk)
    grads = execute_backward(strategy, do, q, k, v, causal=causal, **kw)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, attention_backward64(do, q, k, v, causal)):
        err = np.abs(g - ref).max()
        assert err < TOL, f"{name} mismatch for {strategy} sq={sq} sk={sk} causal={causal}: {err:.2e}"


@pytest.mark.parametrize("strategy", ["fa1", "fa2"])
def test_without_causal_skipping_the_masks_alone_give_the_same_result(strategy):
    q, k, v, do = _inputs(200, 150)
    kw = {"block_m": 32, "block_n": 64}
    o, _ = execute_forward(strategy, q, k, v, causal=True, causal_skip=False, **kw)
    assert np.abs(o - attention_forward64(q, k, v, True)[0]).max() < TOL
    dq, dk, dv = execute_backward(strategy, do, q, k, v, causal=True, causal_skip=False, **kw)
    assert np.abs(dk - attention_backward64(do, q, k, v, True)[1]).max() < TOL


def test_softmax_scale_is_honoured():
    q, k, v, _ = _inputs(64, 96)
    o, lse = execute_forward("cuflash", q, k, v, softmax_scale=0.3)
    o_ref, lse_ref = attention_forward64(q, k, v, False, 0.3)
    assert np.abs(o - o_ref).max() < TOL and np.abs(lse - lse_ref).max() < TOL


Z = np.zeros((1, 4, 1, 8))


@pytest.mark.parametrize("args,err,match", [
    (("fa9", Z, Z, Z), ValueError, "strategy='fa9'"),
    (("fa2", Z[0], Z, Z), ValueError, "q must be"),
    (("fa2", [[1.0]], Z, Z), TypeError, "NumPy array"),
    (("fa2", Z, Z, np.zeros((1, 5, 1, 8))), ValueError, "shapes do not match"),
])
def test_bad_inputs_are_explained(args, err, match):
    with pytest.raises(err, match=match):
        execute_forward(*args)


@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113), (1, 239), (130, 517)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (300, 10))])
@pytest.mark.parametrize("kernels", ["auto", "mma"])
def test_deterministic_dq_schedule_equals_reference(sq, sk, causal, window, kernels):
    """The deterministic backward's dQ: with "mma" (bwd_kernel) bwd_dq_kernel's Q-outer schedule (dq_config tiles,
    key tiles last to first, +inf lse_log2 on rows without keys); with "auto" (bwd_sm90_ws_kernel, d 40 on its 64
    kernel: the ordered path) the K/V-outer accumulation, each query block's key blocks summed from the last to the
    first with causal or a window, else from the first. Either equals the reference, and is bitwise the schedule
    it names (the key-block order shows where a query block sums three or more: 517 keys)."""
    from cuflash.simulator import execute as ex

    q, k, v, do = _inputs(sq, sk)
    dq, dk, dv = execute_backward("cuflash", do, q, k, v, causal=causal, window=window, deterministic=True,
                                  kernels=kernels)
    _check_grads(do, q, k, v, (dq, dk, dv), causal, window)
    p = ex._problem(q, k, "fp16", causal, window)
    scale = 1.0 / math.sqrt(40)
    o, lse = execute_forward("cuflash", q, k, v, causal=causal, window=window, kernels=kernels)
    if kernels == "auto":  # 128 queries x 128 keys, 64 columns
        want = ex._kv_outer_bwd(do, q, k, v, o, lse, p, scale, 128, 128, 64, True,
                                reverse_n=causal or window is not None)[0]
    else:  # dq_config(64, "fp16", ...): 128 queries x 64 keys
        want = ex._q_outer_dq(do, q, k, v, o, lse, p, scale, 128, 64, 64, True)
    assert np.array_equal(dq, want)


@pytest.mark.parametrize("kernels", ["auto", "mma"])
def test_cuflash_schedule_uses_the_launched_tiles(kernels):
    """The execute mode runs the tiles of what the library launches (cuflash.config): at head dim 104
    (kernel 128) the wgmma kernels' with kernels="auto", the mma.sync kernels' with "mma"; the result
    equals the reference with either."""
    from cuflash import config
    from cuflash.simulator import Problem
    from cuflash.simulator.execute import _blocks_and_width

    p = Problem(1, 1, 200, 150, 104, "bf16", True)
    fwd = config.forward_kernel_config(128, "bf16", True, kernels=kernels)
    bwd = config.backward_kernel_config(128, "bf16", True, False, kernels=kernels)
    assert isinstance(fwd, (config.FwdSm90Config, config.FwdSm90WsConfig)) == (kernels == "auto")
    assert _blocks_and_width("cuflash", p, None, None, None, False, kernels) == (fwd.block_m, fwd.block_n, 128)
    assert _blocks_and_width("cuflash", p, None, None, None, True, kernels) == (bwd.block_m, bwd.block_n, 128)
    q, k, v, do = _inputs(200, 150, d=104, b=1, h=1)
    grads = execute_backward("cuflash", do, q, k, v, causal=True, dtype="bf16", kernels=kernels)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, attention_backward64(do, q, k, v, True)):
        err = np.abs(g - ref).max()
        assert err < TOL, f"{name} mismatch with kernels={kernels}: {err:.2e}"
    with pytest.raises(ValueError, match="kernels='mma'"):
        execute_forward("fa2", q, k, v, kernels="mma")


@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113), (130, 517)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (300, 10))])
@pytest.mark.parametrize("dtype,d,tiles", [("fp64", 40, (32, 64, 64)), ("fp32", 120, (32, 64, 128))])
def test_deterministic_wide_dq_schedule_equals_reference(sq, sk, causal, window, dtype, d, tiles):
    """The ordered bwd_wide_kernel's dQ: the K/V-outer accumulation on the deterministic tiles (fp64 d 40 on the 64
    kernel: 32 queries x 64 keys, not the default mode's 16 x 128; fp32 d 120 on the 128 kernel: 32 x 64), each query
    block's key blocks summed from the last to the first with causal or a window, else from the first. Equals the
    reference, and bitwise the schedule it names. (fp32 at head dim 128 runs the TF32 cluster pairs on sm_90a by
    default: the wide kernels are kernels="mma" there.)"""
    from cuflash.simulator import execute as ex

    kernels = "mma" if dtype == "fp32" else "auto"
    q, k, v, do = _inputs(sq, sk, d=d)
    dq, dk, dv = execute_backward("cuflash", do, q, k, v, causal=causal, window=window, deterministic=True,
                                  dtype=dtype, kernels=kernels)
    _check_grads(do, q, k, v, (dq, dk, dv), causal, window)
    p = ex._problem(q, k, dtype, causal, window)
    o, lse = execute_forward("cuflash", q, k, v, causal=causal, window=window, dtype=dtype, kernels=kernels)
    bm, bn, width = tiles
    want = ex._kv_outer_bwd(do, q, k, v, o, lse, p, 1.0 / math.sqrt(d), bm, bn, width, True,
                            reverse_n=causal or window is not None)[0]
    assert np.array_equal(dq, want)


def test_deterministic_tf32_backward_is_the_default_run():
    """fp32 at head dim 64 on sm_90a runs the float32 Hopper backward (no atomics) in either mode: the deterministic
    execution is the default one, bitwise."""
    q, k, v, do = _inputs(203, 113, d=64)
    det = execute_backward("cuflash", do, q, k, v, causal=True, deterministic=True, dtype="fp32")
    default = execute_backward("cuflash", do, q, k, v, causal=True, dtype="fp32")
    assert all(np.array_equal(a, b) for a, b in zip(det, default))
