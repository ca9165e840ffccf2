"""`python -m cuflash.check`, the sanitizer runner: its case set, sharding and log parsing (no GPU needed)."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from cuflash import check, config

CLEAN_LOG = """\
/usr/local/cuda/bin/compute-sanitizer --tool memcheck ...
========= COMPUTE-SANITIZER
CASE 1/2 d64-fp16-causal-113x203-b1h2-bshd-padded
RESULT {"case": "a", "seconds": 0.1, "digests": {"o": "1"}, "problems": []}
CASE 2/2 d128-bf16-full-1023x17-b2h1-bhsd-transposed
RESULT {"case": "b", "seconds": 0.1, "digests": {"o": "2"}, "problems": []}
DRIVER DONE 2 cases, 0 with problems
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERROR_LOG = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at cuflash::fwd_kernel<...>+0x1a40
=========     by thread (3,0,0) in block (0,1,0)
=========     Address 0x7f0000001000 is out of bounds
=========
RESULT {"case": "a", "seconds": 0.1, "digests": {"o": "1"}, "problems": []}
DRIVER DONE 1 cases, 0 with problems
========= ERROR SUMMARY: 1 error
"""

RACECHECK_LOG = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at bwd_kernel+0x100
=========     and Read access at bwd_kernel+0x200 [64 hazards]
DRIVER DONE 0 cases, 0 with problems
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 2 warnings)
"""


def test_default_cases_cover_every_shipped_instantiation():
    """Each case runs forward, both backward modes, so the set, run once per kernel family (wgmma by
    default on sm_90a, and CUFLASH_KERNELS=mma), must launch every config the library has."""
    launched = {cfg for case in check.default_cases() for kernels in config.KERNEL_FAMILIES
                for cfg in case.configs(kernels=kernels)}
    shipped = set(config.all_fwd_configs()) | set(config.all_bwd_configs())
    assert shipped <= launched, f"never launched under the sanitizers: {sorted(map(str, shipped - launched))}"


def test_cases_have_the_required_variety():
    cases = check.default_cases()
    narrow = [c for c in cases if c.dtype in config.DTYPES]
    assert {c.kernel_head_dim for c in narrow} == set(config.KERNEL_HEAD_DIMS)
    assert any(c.head_dim not in config.KERNEL_HEAD_DIMS for c in narrow)  # a zero-padded head dim
    assert {c.dtype for c in cases} == {*config.DTYPES, *config.WIDE_DTYPES}
    assert {c.causal for c in cases} == {False, True}
    assert {c.layout for c in cases} == {"bshd", "bhsd"} and set(check.STRIDES) <= {c.strides for c in cases}
    seqlens = {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {1, 17, 113, 1023} <= seqlens
    assert any(c.seqlen_q > c.seqlen_k and c.causal for c in cases)  # rows that see no key
    assert any(c.seqlen_q < c.seqlen_k and c.causal for c in cases)
    assert len({c.name for c in cases}) == len(cases)
    # sanitizers are slow: tiny problems (a few more heads where GQA, varlen batches or kv caches need them)
    assert max(c.batch * c.heads for c in cases if c.kind == "dense" and c.heads_kv == c.heads) <= 2
    # (one head of 130 queries over 8244 keys: the Hopper forward's long-key tiles at head dim 64 start past 8192)
    assert max(c.batch * c.heads * max(c.seqlen_q, c.seqlen_k) for c in cases) <= 8244
    # (and four FP8 cases of one head, 200 queries over 4112 keys: the one-item grid past the persistent grid's rows)
    assert sum(c.batch * c.heads * max(c.seqlen_q, c.seqlen_k) > 4 * 1024 for c in cases) <= 8
    # the features: grouped-query (incl. multi-query) heads, packed sequences, kv caches dense and paged,
    # with and without split-KV
    assert {c.heads // c.heads_kv for c in cases} >= {1, 2, 4}
    assert {c.kind for c in cases} == set(check.KINDS)
    kv = [c for c in cases if c.kind == "kvcache"]
    assert {c.paged for c in kv} == {False, True} and {c.splits for c in kv} >= {0, 1, 3}
    assert {c.dtype for c in kv} == set(config.DTYPES)  # the decode kernels are 16-bit only


def test_wide_cases_have_the_required_variety():
    """Each float32 / float64 kernel dtype: every kernel head dim, a zero-padded one, causal rows that see no key and
    causal Sq < Sk, single rows, both layouts, every stride kind, grouped-query heads, packed sequences; no case
    beyond the 16-bit cases' sizes, and the wide cases together cost less under the sanitizers than the 16-bit ones."""
    cases = check.default_cases()
    for dtype in config.WIDE_DTYPES:
        mine = [c for c in cases if c.dtype == dtype]
        assert {c.kernel_head_dim for c in mine} == set(config.WIDE_KERNEL_HEAD_DIMS[dtype]), dtype
        assert any(c.head_dim != c.kernel_head_dim for c in mine), dtype
        assert any(c.seqlen_q > c.seqlen_k and c.causal for c in mine), dtype
        assert any(c.seqlen_q < c.seqlen_k and c.causal for c in mine), dtype
        assert any(min(c.seqlen_q, c.seqlen_k) == 1 for c in mine), dtype
        dense = [c for c in mine if c.kind == "dense"]
        assert {c.layout for c in dense} == set(check.LAYOUTS) and {c.strides for c in dense} == set(check.STRIDES)
        assert any(c.heads_kv < c.heads for c in mine) and {c.kind for c in mine} == {"dense", "varlen"}, dtype
        assert all(c.precision == ("tf32" if dtype == "tf32" else None) for c in mine)
    wide = [c for c in cases if c.wide]
    assert max(c.batch * c.heads * max(c.seqlen_q, c.seqlen_k) for c in wide) <= 4 * 1024
    assert sum(c.cost for c in wide) < sum(c.cost for c in cases if not c.wide)


def test_wide_cases_launch_the_ordered_deterministic_kernel():
    """float32 / float64 cases launch the forward, the default backward and the deterministic one (bwd_wide_kernel's
    ORDERED form: the same dQ accumulator, its adds in a fixed order; the TF32 wgmma backward is deterministic as it
    is), the preprocess and the dQ conversion or, on the TF32 wgmma backward, its dQ kernel (and the dropout mask
    kernel with dropout), all of their own dtype, and never the 16-bit dQ kernel."""
    for case in check.default_cases():
        if not case.wide:
            continue
        for kernels in config.KERNEL_FAMILIES:
            cfgs = case.configs(kernels=kernels)
            assert not any(isinstance(c, config.DqConfig) for c in cfgs), case.name
            wide_bwd = [c for c in cfgs if isinstance(c, config.BwdWideConfig)]
            assert [c.deterministic for c in wide_bwd] in ([], [False, True]), (case.name, wide_bwd)
            # the forward: on sm_90a with the default kernels the TF32 wgmma one where it has a kernel (a BlockMask's
            # case runs the mask kernels, which read its map)
            mods = (case.mods & ~config.MOD_BLOCKS) | config.MOD_MASK if case.mods & config.MOD_BLOCKS else case.mods
            tf32 = case.dtype != "fp64" and kernels == "auto" and case.kernel_head_dim in config.FWD_SM90_TF32_TILES[
                "fp32"] and not mods & ~config.FWD_SM90_TF32_MODS and config.DEFAULT_ARCH == "sm_90a"
            fwd = config.FwdSm90Tf32Config if tf32 else config.FwdWideConfig
            # the backward: the TF32 wgmma one (and its dQ kernel) at the head dims and modifiers it has
            tf32_bwd = case.dtype != "fp64" and kernels == "auto" and case.kernel_head_dim in \
                config.BWD_SM90_TF32_TILES["fp32"] and not mods & ~config.BWD_SM90_TF32_MODS and \
                config.DEFAULT_ARCH == "sm_90a"
            bwd = {config.BwdSm90Tf32Config, config.BwdDqSm90Tf32Config} if tf32_bwd else {config.BwdWideConfig}
            assert {type(c) for c in cfgs} == {fwd, config.ElementwiseConfig} | bwd | (
                {config.DropoutMaskConfig} if case.mods & config.MOD_DROPOUT else set()) | (
                {config.PaddingTilesConfig} if case.padding else set()), case.name
            assert all(c.dtype == case.dtype for c in cfgs if hasattr(c, "dtype")), case.name


def test_strided_views_are_copied_exactly_when_misaligned():
    """The driver's strided inputs (built here on NumPy buffers): a "misaligned" case has inputs the library must
    copy (strides not a multiple of 16 bytes, _validate.needs_aligned_copy), for every element size (an input of
    one row, head and batch has no stride that matters); the other stride kinds are taken as they are."""
    import numpy as np

    from cuflash import _validate

    np_dtypes = {"fp16": np.float16, "bf16": np.float16, "fp32": np.float32, "tf32": np.float32, "fp64": np.float64}
    for case in check.default_cases() + check.quick_cases():
        if case.kind != "dense":
            continue
        copied = []
        for seqlen, heads in ((case.seqlen_q, case.heads), (case.seqlen_k, case.heads_kv)):
            bases = []

            def make(shape):
                bases.append(np.zeros(shape, dtype=np_dtypes[case.dtype]))
                return bases[-1]

            x = check.strided_view(case, seqlen, heads, make)
            item = x.dtype.itemsize
            ptr = 256 + x.__array_interface__["data"][0] - bases[0].__array_interface__["data"][0]  # cudaMalloc: 256
            info = _validate.ArrayInfo("q", x.shape, x.dtype, tuple(s // item for s in x.strides), ptr, 0)
            dims = _validate.bshd_dims(info, case.layout)
            assert (dims.batch, dims.seqlen, dims.heads, dims.head_dim) == (case.batch, seqlen, heads, case.head_dim)
            copied.append(_validate.needs_aligned_copy(info, dims))
        assert any(copied) == (case.strides == "misaligned"), case.name


def test_nan_checks_use_each_dtypes_exponent_field():
    import ml_dtypes
    import numpy as np

    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        dt = np.dtype(dtype)
        inf_bits = int(np.array(np.inf, dtype=dt).view(np.dtype(check._UINT[dt.itemsize])))
        assert check._EXP_MASKS[dt.name] == inf_bits, dt


def test_shards_balance_cost_and_cover_each_case_once():
    cases = check.default_cases()
    shards = check.shard(cases, list(range(len(cases))), 5)
    assert sorted(i for s in shards for i in s) == list(range(len(cases)))
    loads = [sum(cases[i].cost for i in s) for s in shards]
    assert max(loads) <= 1.5 * min(loads)
    assert check.shard(cases, [3], 4) == [[3]]


def test_parse_clean_log():
    parsed = check.parse_log(CLEAN_LOG)
    assert parsed["errors"] == 0 and parsed["done"] and not parsed["findings"]
    assert [r["case"] for r in parsed["results"]] == ["a", "b"]


def test_parse_memcheck_error_keeps_the_report():
    parsed = check.parse_log(MEMCHECK_ERROR_LOG)
    assert parsed["errors"] == 1
    assert any("Invalid __global__ read" in line for line in parsed["findings"])
    assert any("out of bounds" in line for line in parsed["findings"])


def test_parse_racecheck_summary_counts_errors_and_warnings():
    parsed = check.parse_log(RACECHECK_LOG)
    assert parsed["race_errors"] == 1 and parsed["race_warnings"] == 2 and parsed.get("race_summary")
    assert any("Race reported" in line for line in parsed["findings"])


HAZARD_LOG = """\
========= Error: Potential RAW hazard detected at __shared__ 0xa40 in block (12,0,0) :
=========     Write Thread (144,0,0) at void cuflash::k<cuflash::T<(int)128, cuflash::f16>, (bool)0>(cuflash::P)+0x4920
=========     Read Thread (320,0,0) at void cuflash::k<cuflash::T<(int)128, cuflash::f16>, (bool)0>(cuflash::P)+0x5030
=========     Current Value : 114
========= Error: Potential RAW hazard detected at __shared__ 0xa41 in block (12,0,0) :
=========     Write Thread (145,0,0) at void cuflash::k<cuflash::T<(int)128, cuflash::f16>, (bool)0>(cuflash::P)+0x4920
=========     Read Thread (321,0,0) at void cuflash::k<cuflash::T<(int)128, cuflash::f16>, (bool)0>(cuflash::P)+0x5030
=========     Current Value : 24
========= Error: Potential WAR hazard detected at __shared__ 0x1c400 in block (0,1,0) :
=========     Read Thread (156,0,0) at void cuflash::k<cuflash::T<(int)64, cuflash::f16>, (bool)1>(cuflash::P)+0x1740
=========     Write Thread (0,0,0) at void cuflash::k<cuflash::T<(int)64, cuflash::f16>, (bool)1>(cuflash::P)+0x5150
DRIVER DONE 1 cases, 0 with problems
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""


def test_hazard_sites_group_findings_by_instruction_pair():
    sites = check.hazard_sites(check.parse_log(HAZARD_LOG)["findings"])
    assert sites == [
        (2, "RAW cuflash::k<cuflash::T<(int)128, cuflash::f16>, (bool)0>: Write +0x4920, Read +0x5030"),
        (1, "WAR cuflash::k<cuflash::T<(int)64, cuflash::f16>, (bool)1>: Read +0x1740, Write +0x5150")]
    assert check.hazard_sites(check.parse_log(RACECHECK_LOG)["findings"]) == []  # no per-access lines to group


def test_tool_options_only_use_flags_the_sanitizer_lists():
    help_text = "--error-exitcode <number>\n--print-limit <number>\n--racecheck-report <mode>\n"
    assert check.tool_options("racecheck", help_text) == ["--error-exitcode", "99", "--print-limit", "200",
                                                          "--racecheck-report", "all"]
    assert check.tool_options("memcheck", "") == ["--error-exitcode", "99"]
    full = help_text + "--padding <n>\n--launch-timeout <n>\n--racecheck-memcpy-async <yes|no>\n--report-api-errors\n"
    assert "--padding" in check.tool_options("memcheck", full)
    assert check.tool_options("racecheck", full)[-2:] == ["--racecheck-memcpy-async", "yes"]
    assert "--report-api-errors" in check.tool_options("synccheck", full)
    assert "--padding" not in check.tool_options("initcheck", full)


def test_driver_command_and_case_listing(capsys):
    cmd = check._driver_cmd("quick", [0, 2], verify=True)
    assert cmd[1:] == ["-m", "cuflash.check", "_driver", "--case-set", "quick", "--cases", "0,2", "--verify"]
    assert check.main(["cases", "--quick"]) == 0
    out = capsys.readouterr().out
    assert f"{len(check.quick_cases())} cases" in out
    cases = check.default_cases()
    assert check.select_cases(cases, "fp32|tf32|fp64") == [i for i, c in enumerate(cases) if c.wide]
    assert check.select_cases(cases, None) == list(range(len(cases)))
    assert check.main(["cases", "--only", "fp64"]) == 0
    assert f"{sum(c.dtype == 'fp64' for c in cases)} cases" in capsys.readouterr().out
    json.dumps([c.name for c in check.default_cases()])


# --- the driver on the host: CuPy replaced by NumPy, the kernels by plain attention --------------------------------

class _NumpyCupy(types.ModuleType):
    """A stand-in for CuPy that keeps every array on the host (NumPy), for the driver's plumbing on a CPU."""

    def __getattr__(self, name):
        return getattr(np, name)


def _numpy_cupy():
    cp = _NumpyCupy("cupy")
    cp.ndarray = np.ndarray
    cp.asnumpy = lambda x: np.array(x)
    cp.asarray = lambda x, dtype=None: np.array(x, dtype=dtype)  # a new array, as an upload makes
    cp.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None))
    return cp


def _plain_precision(q, precision):
    if q.dtype == np.float64:
        return "fp64"
    return precision or "fp32"


class _FakeKernels:
    """cuflash's dense and varlen attention calls computed by cuflash._xpref's plain attention in the call's
    precision (16-bit: the float64 reference rounded to the dtype), so the driver's pass rules must hold; `spoil`
    adds an error of that relative size to o and dk, which they must find."""

    def __init__(self, spoil=0.0):
        self.spoil = spoil
        self.calls = []

    def _lowp(self, x, like):
        return x.astype(like.dtype)

    def _hurt(self, x):
        if self.spoil and x.size:
            x = x.copy()
            x.reshape(-1)[x.size // 2] += self.spoil * max(1.0, float(np.abs(x).max()))
        return x

    def _options(self, q_bshd, sk, window=None, alibi_slopes=None, softcap=None, bias=None, mask=None, dropout_p=0.0,
                 seed=None, offset=0, **_):
        from cuflash import philox

        opts = dict(window=window, alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask)
        if dropout_p:
            b, sq, h, _ = q_bshd.shape
            opts.update(dropout_p=dropout_p, dropout_mask=philox.dropout_mask(b, h, sq, sk, dropout_p, seed, offset))
        return opts

    def forward(self, q, k, v, *, causal=False, layout="bshd", return_dropout_mask=False, precision=None, **mods):
        from cuflash import _xpref

        self.calls.append(("forward", q.dtype, precision))
        t = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 2, 1, 3))
        qb, kb, vb = t(q), t(k), t(v)
        opts = self._options(qb, kb.shape[1], **mods)
        if q.dtype.itemsize == 2:
            assert not mods
            o, lse = _xpref.attention_forward64(qb, kb, vb, causal)
        else:
            o, lse = _xpref.attention_plain(qb, kb, vb, _plain_precision(q, precision), causal, **opts)
        o = np.ascontiguousarray(t(self._hurt(o).astype(q.dtype)))
        out = (o, lse.astype(np.float64 if q.dtype == np.float64 else np.float32))
        return out + ((opts["dropout_mask"],) if return_dropout_mask else ())

    def backward(self, dout, q, k, v, o, lse, *, causal=False, layout="bshd", deterministic=False, dbias=False,
                 precision=None, **mods):
        from cuflash import _xpref

        self.calls.append(("backward", q.dtype, precision))
        t = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 2, 1, 3))
        dob, qb, kb, vb = t(dout), t(q), t(k), t(v)
        opts = self._options(qb, kb.shape[1], **mods)
        if q.dtype.itemsize == 2:
            assert not mods
            g = _xpref.attention_backward64(dob, qb, kb, vb, causal)
        else:
            g = _xpref.attention_backward_plain(dob, qb, kb, vb, _plain_precision(q, precision), causal, **opts)
        grads = [np.ascontiguousarray(t(gi.astype(x.dtype))) for gi, x in zip(g[:3], (q, k, v))]
        grads[1] = np.ascontiguousarray(t(self._hurt(t(grads[1]))))
        return tuple(grads) + ((g[3].astype(np.float32),) if dbias else ())

    def varlen_forward(self, q, k, v, cu_q, cu_k, mq, mk, *, causal=False, precision=None):
        from cuflash import _xpref

        self.calls.append(("varlen_forward", q.dtype, precision))
        if q.dtype.itemsize == 2:
            o, lse = _xpref.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal)
        else:
            o, lse = _xpref.attention_varlen_plain(q, k, v, cu_q, cu_k, _plain_precision(q, precision), causal)
        return self._hurt(o).astype(q.dtype), lse.astype(np.float64 if q.dtype == np.float64 else np.float32)

    def varlen_backward(self, dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, *, causal=False, deterministic=False,
                        precision=None):
        from cuflash import _xpref

        self.calls.append(("varlen_backward", q.dtype, precision))
        if q.dtype.itemsize == 2:
            g = _xpref.attention_varlen_backward64(dout, q, k, v, cu_q, cu_k, causal)
        else:
            g = _xpref.attention_varlen_backward_plain(dout, q, k, v, cu_q, cu_k, _plain_precision(q, precision),
                                                      causal)
        return g[0].astype(q.dtype), self._hurt(g[1]).astype(k.dtype), g[2].astype(v.dtype)


@pytest.fixture
def host_driver(monkeypatch):
    """check.run_case on the host: CuPy is NumPy, the attention calls are _FakeKernels'."""
    import cuflash

    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setattr(check, "_FLOAT32_MATMUL", {})

    def install(fake):
        for name, fn in (("attention_forward", fake.forward), ("attention_backward", fake.backward),
                         ("attention_varlen_forward", fake.varlen_forward),
                         ("attention_varlen_backward", fake.varlen_backward)):
            monkeypatch.setattr(cuflash, name, fn)
        return fake

    return install


# one case of each wide kind: plain and modifier cases of every dtype, padded / transposed / misaligned views, bhsd,
# grouped-query heads, packed sequences, and 16-bit cases (their path must be unchanged)
HOST_CASES = ("d32-fp32-causal-1x1-b2h1-bhsd-padded", "d64-fp32-full-1x1023-b1h2-bshd-transposed",
              "d64-tf32-full-17x17-b2h1-bhsd-misaligned", "d8-fp64-full-1023x17-b2h1-bhsd-misaligned",
              "d32-fp32-full-137x71-b1h2-bshd-contiguous-window-alibi-softcap-dropout-bias-mask",
              "d32-tf32-causal-71x137-b1h2-bshd-contiguous-alibi-softcap-dropout-bias-mask",
              "d32-fp64-full-137x71-b1h1-bshd-contiguous-window", "d32-fp64-causal-17x203-b1h4kv1-bshd-contiguous",
              "d64-tf32-full-203x113-b4h2-varlen", "d40-fp64-causal-113x203-b4h2kv1-varlen",
              "d8-fp16-full-17x1023-b2h1-bshd-misaligned", "d64-fp16-full-203x113-b4h2-varlen")


def test_driver_runs_the_wide_cases_on_the_host(host_driver):
    """The driver's calls, outputs, digests and pass rules for float32 / float64 cases (and 16-bit ones), with
    kernels that compute plain attention: no problems, the deterministic backward run for every dtype, precision
    "tf32" passed for the TF32 cases (the deterministic backward's too), lse float64 for float64 inputs."""
    by_name = {c.name: c for c in check.default_cases()}
    for name in HOST_CASES:
        case = by_name[name]
        fake = host_driver(_FakeKernels())
        result = check.run_case(case, verify=True)
        assert result["problems"] == [], (name, result["problems"])
        digests = set(result["digests"])
        assert {"o", "lse", "dk", "dv"} <= digests and "dq_atomic" not in digests
        assert {"dq_det", "dk_det", "dv_det"} <= digests, name
        assert {p for _, _, p in fake.calls} == {case.precision}, name
        assert len(fake.calls) == 3, name
        want = {"fp32": np.float32, "tf32": np.float32, "fp64": np.float64}.get(case.dtype)
        if want is not None:
            assert {dt for _, dt, _ in fake.calls} == {np.dtype(want)}, name


@pytest.mark.parametrize("name, spoil", [("d32-fp32-full-137x71-b1h2-bshd-contiguous-window-alibi-softcap-dropout-"
                                          "bias-mask", 1e-4),
                                         ("d64-tf32-full-17x17-b2h1-bhsd-misaligned", 1e-2),
                                         ("d8-fp64-full-1023x17-b2h1-bhsd-misaligned", 1e-10),
                                         ("d40-fp64-causal-113x203-b4h2kv1-varlen", 1e-10)])
def test_driver_pass_rules_find_wrong_wide_outputs(host_driver, name, spoil):
    case = {c.name: c for c in check.default_cases()}[name]
    host_driver(_FakeKernels(spoil=spoil))
    problems = check.run_case(case, verify=True)["problems"]
    assert any(p.startswith("o: ") for p in problems) and any(p.startswith("dk: ") for p in problems), problems
    assert any(p.startswith("det dk: ") for p in problems), problems  # the deterministic backward's rule
