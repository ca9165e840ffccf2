"""The wide-head Hopper backward (bwd_sm90_split_kernel: head dims 192 and 256, two warpgroups each keeping half the
head dim of dK and dV, P^T and dS^T exchanged through shared memory): that the library launches it on an H100, and
what the general backward tests (test_gpu_backward.py at D 256 and the padded D 200, test_gpu_mods.py's modifiers at
D 192, 200 and 256, which run on it there) do not reach: many query blocks per CTA with GQA steps and a key tail on a
poisoned pool, the padded head dims of both instantiations, deterministic mode, and the mma.sync kernel beside it on
the same inputs. Pass rule as everywhere (docs/RELIABILITY.md): max|dX - dX_ref64| <= 3 * max|dX_lowp - dX_ref64| +
1e-5. Needs an sm_90 GPU (skipped elsewhere, like every `gpu` test).
"""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _compile, _families, _plan, _xpref, config  # noqa: E402
from gpu_helpers import backward_problem, check_backward, max_abs, poison_pool, round_up  # noqa: E402

pytestmark = pytest.mark.gpu
KINDS = ("contiguous", "padded", "contiguous", "contiguous")  # q, k, v, dout: k with padded rows


@pytest.fixture(scope="module", autouse=True)
def _hopper_only():
    arch = _compile.device_arch()
    if not config.uses_wgmma(arch):  # another GPU, or CUFLASH_KERNELS=mma: the wgmma kernels do not run
        pytest.skip(f"bwd_sm90_split_kernel needs an sm_90 GPU (wgmma) with the wgmma kernels on "
                    f"(here {arch}, CUFLASH_KERNELS={config.KERNELS})")


def problem(b, sq, sk, hq, hkv, d, dtype, causal, key=()):
    return backward_problem("bwd-split", b, sq, sk, hq, hkv, d, dtype, causal, KINDS, key)


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_library_launches_the_split_backward_on_hopper(d, dtype):
    arch = _compile.device_arch()
    for causal, mods, det in ((False, 0, False), (True, 0, True), (False, config.MOD_WINDOW, False),
                              (True, config.MOD_ALIBI | config.MOD_SOFTCAP | config.MOD_DROPOUT, False)):
        cfg = config.backward_kernel_config(d, dtype, causal, det, arch, mods=mods)
        assert isinstance(cfg, config.BwdSm90SplitConfig) and cfg.deterministic == det, cfg
    biased = config.backward_kernel_config(d, dtype, False, False, arch, mods=config.MOD_BIAS)
    assert isinstance(biased, config.BwdConfig), "a bias keeps the mma.sync backward"


@pytest.mark.parametrize("d", [160, 192, 200, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_many_query_blocks_and_gqa_steps(d, causal, dtype):
    """1000 queries = 16 query blocks per query head, 4 query heads per K/V head: 64 steps per CTA through the
    2-stage TMA ring; 700 keys = a key tail (700 = 10 x 64 + 60); head dims 160 and 200 zero-padded in the 192
    and 256 kernels; poisoned pool (dQ_acc, dQ's pad rows)."""
    q, k, v, dout, o, lse = problem(2, 1000, 700, 8, 2, d, dtype, causal)
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    check_backward(grads, q, k, v, dout, dtype, causal, f"split D={d} {dtype} causal={causal} GQA 8/2")


@pytest.mark.parametrize("sq,sk", [(1, 239), (239, 1), (64, 64), (65, 129)])
def test_short_and_tail_blocks(sq, sk):
    """A single query row, a single key, exactly one block each, one row and one key past a block."""
    q, k, v, dout, o, lse = problem(2, sq, sk, 2, 1, 256, "bf16", True, key=("short",))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True)
    check_backward(grads, q, k, v, dout, "bf16", True, f"split Sq={sq} Sk={sk}")


@pytest.mark.parametrize("d", [192, 256])
def test_deterministic_mode_repeats_bitwise(d):
    q, k, v, dout, o, lse = problem(1, 1023, 1024, 2, 2, d, "fp16", True, key=("det",))
    first = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))
    check_backward(first, q, k, v, dout, "fp16", True, f"deterministic split D={d}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_and_mma_kernels_agree(causal, monkeypatch):
    """The same inputs through bwd_sm90_split_kernel and the mma.sync bwd_kernel (CUFLASH_KERNELS=mma): both within
    the rule, and close to each other (the same products in another order)."""
    q, k, v, dout, o, lse = problem(2, 517, 1030, 4, 4, 256, "bf16", causal, key=("mma",))
    split = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    monkeypatch.setattr(config, "KERNELS", "mma")
    monkeypatch.setattr(_families, "_selected", {})
    monkeypatch.setattr(_plan, "plans", _plan.PlanCache())
    assert isinstance(config.backward_kernel_config(256, "bf16", causal, False, "sm_90a"), config.BwdConfig)
    mma = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    check_backward(split, q, k, v, dout, "bf16", causal, f"split causal={causal}")
    check_backward(mma, q, k, v, dout, "bf16", causal, f"mma causal={causal}")
    for name, a, b in zip(("dq", "dk", "dv"), split, mma):
        a32, b32 = _xpref.to_float32(a), _xpref.to_float32(b)
        assert max_abs(a32 - b32) <= 0.02 * max_abs(b32), f"{name}: split and mma.sync kernels differ"


# (Sq, Sk, H_q, H_kv, causal): a key tail, GQA steps, causal rows with Sq > Sk and Sq < Sk (the reversed grid and the
# descending turns), and more CTAs than an H100 or H200 runs at once (2 x 8 x 16 = 256), so that some wait on turns of
# CTAs of an earlier wave
ORDERED_CASES = [(517, 700, 4, 2, False), (700, 517, 4, 4, True), (300, 1000, 2, 1, True), (1000, 1000, 8, 8, True),
                 (1000, 1000, 8, 8, False)]


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("sq,sk,hq,hkv,causal", ORDERED_CASES)
def test_deterministic_dq_in_turns(sq, sk, hq, hkv, causal, d, monkeypatch):
    """deterministic=True with the kernel adding dQ itself, each key block in its turn per query block
    (config.ordered_dq; the default at head dim 256, asked for here at 192 too): bitwise equal over three runs and
    within the rule; the other path (dQ from bwd_dq_kernel, the default at 192) within the rule on the same inputs,
    dK and dV bitwise equal to it."""
    q, k, v, dout, o, lse = problem(2, sq, sk, hq, hkv, d, "bf16", causal, key=("ordered",))
    monkeypatch.setattr(config, "BWD_SM90_SPLIT_ORDERED", (d,))
    monkeypatch.setattr(_families, "_selected", {})
    monkeypatch.setattr(_plan, "plans", _plan.PlanCache())
    assert config.ordered_dq(config.backward_kernel_config(d, "bf16", causal, True, _compile.device_arch()))
    runs = []
    for _ in range(3):
        poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
        runs.append([g.copy() for g in cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal,
                                                                  deterministic=True)])
    what = f"D={d} Sq={sq} Sk={sk} H {hq}/{hkv} causal={causal}"
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), run, runs[0]):
            assert bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))), f"{name} repeats not bitwise, {what}"
    check_backward(runs[0], q, k, v, dout, "bf16", causal, "ordered " + what)
    monkeypatch.setattr(config, "BWD_SM90_SPLIT_ORDERED", ())
    monkeypatch.setattr(_families, "_selected", {})
    monkeypatch.setattr(_plan, "plans", _plan.PlanCache())
    assert not config.ordered_dq(config.backward_kernel_config(d, "bf16", causal, True, _compile.device_arch()))
    other = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True)
    check_backward(other, q, k, v, dout, "bf16", causal, "bwd_dq_kernel " + what)
    for name, a, b in zip(("dk", "dv"), runs[0][1:], other[1:]):
        assert bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))), f"{name} differs between the paths, {what}"
