"""The compile path without a GPU: representative kernels compile spill-free through NVRTC, the disk cache
key follows the text of every file in cuda/, and ptxas -v logs are read correctly. The full check of every
shipped instantiation is `python -m cuflash compile --arch sm_90a --all` (run by .ci/run)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from cuflash import _compile, config
from cuflash.config import bwd_sm90_config, dq_config, fwd_config, fwd_sm90_config
from compile_helpers import nvrtc_or_skip, sass_loops, sass_or_skip



REPRESENTATIVE = [
    (fwd_config(64, "fp16", False), "sm_80"),
    (fwd_config(128, "bf16", True), "sm_90a"),
    (fwd_config(256, "bf16", False), "sm_90a"),
    (fwd_sm90_config(128, "bf16", True), "sm_90a"),
    (bwd_sm90_config(128, "fp16", True, False), "sm_90a"),
]


@pytest.mark.parametrize("cfg,arch", REPRESENTATIVE, ids=lambda x: x if isinstance(x, str) else
                         f"{type(x).__name__}-d{x.head_dim}-{x.dtype}-{'causal' if x.causal else 'full'}")
def test_representative_kernels_compile_without_spills(cfg, arch):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), arch, use_cache=False)
    res = compiled.resources
    assert compiled.cubin and compiled.lowered_name.startswith("_Z"), compiled.log
    assert res["registers"] is not None and res["registers"] <= 255, f"{cfg}: {res}\n{compiled.log}"
    spills = (res["spill_stores"], res["spill_loads"], res["stack"])
    assert spills == (0, 0, 0), f"{cfg} on {arch} spills (stores, loads, stack) = {spills}\n{compiled.log}"
    assert res["static_smem"] + cfg.smem_bytes <= 227 * 1024


# tiles of more than 4 chunks per thread in panel order: fwd_kernel's K / V (every key step on sm_80) and bwd_dq_kernel's
ROLLED_COPIES = [
    (fwd_config(96, "bf16", False, "sm_80"), "sm_80"),
    (fwd_config(256, "bf16", True, "sm_80"), "sm_80"),
    (fwd_config(96, "bf16", False, "sm_80", mods=63), "sm_80"),  # 32-key tiles over 256 threads: 1.5 chunks each
    (dq_config(192, "bf16", False), "sm_90a"),
    (dq_config(256, "bf16", True), "sm_80"),
]


@pytest.mark.parametrize("cfg,arch", ROLLED_COPIES, ids=lambda x: x if isinstance(x, str) else
                         f"{type(x).__name__}-d{x.head_dim}-{'causal' if x.causal else 'full'}-mods{x.mods}")
def test_rolled_tile_copies_step_by_panels(cfg, arch):
    """load_tile_async's long panel-order copies loop over panel steps, also where the threads do not divide the
    tile evenly: a few instructions per cp.async (rolled over the chunk index, each chunk's row, column and swizzle
    derived anew, they took 38-46), and one basic block, so one set of the 3 predicated-off LDS the analyzer counts
    (banks.copy_code_blocks), per step."""
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), arch)
    text = sass_or_skip(compiled.cubin)
    copies = [loop for loop in sass_loops(text) if "LDGSTS.E.BYPASS.128" in loop and len(loop) < 200]
    assert copies, "no copy loop"
    for loop in copies:
        per_copy = len(loop) / loop.count("LDGSTS.E.BYPASS.128")
        assert per_copy <= 16, (per_copy, loop)  # (8-11; an uneven copy's loop, with its exit test, 15)
        assert loop.count("LDS") == 3 and loop[-1] == "BRA", loop
    assert compiled.resources["spill_stores"] == 0 and compiled.resources["spill_loads"] == 0


# the decode kernel at every head dim, with its heaviest modifier set: its row gathers (the GQA-packed Q tile, a paged
# cache's tiles that straddle pages) and the dense K / V copies of its key loop
DECODE_GATHERS = [(config.fwd_decode_config(d, "bf16", False, config.MODS_DECODE_CHECKED[False][0]), arch)
                  for d in sorted(config.DECODE_TILES) for arch in ("sm_80", "sm_90a")]


@pytest.mark.parametrize("cfg,arch", DECODE_GATHERS, ids=lambda x: x if isinstance(x, str) else f"d{x.head_dim}")
def test_decode_row_gathers_take_one_row_pointer_per_row(cfg, arch):
    """load_tile_rows_async asks its cursor for one pointer per row of the thread and copies the row's chunks from
    it, K's and V's together: 9-20 instructions per cp.async for a paged tile's rows, up to 45 for the Q tile's (a
    division by the GQA group size per row). A pointer and a row lookup per 16-byte chunk cost 63-77, and 16- and
    48-row pages decoded 1.6-1.9x slower than a dense cache on an H200 (1.01-1.24x since). Spill-free: once the gather got cheaper, ptxas kept the dense copies' row offsets across the key loop and
    spilled 28-68 bytes at head dim 128, until the row stride was made opaque at each copy (cuda/fwd.cuh)."""
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), arch)
    text = sass_or_skip(compiled.cubin)
    copies = lambda loop: sum(op.startswith("LDGSTS") for op in loop)  # (sm_80 also takes the .ZFILL form)
    gathers = [loop for loop in sass_loops(text) if copies(loop) and len(loop) < 200]
    assert gathers, "no row-gather loop"  # (at head dim 96 a K / V tile's thread copies one row: no loop)
    for loop in gathers:
        per_copy = len(loop) / copies(loop)
        q_tile = "IMAD.HI.U32" in loop  # the Q tile's rows: a division by the group size
        assert per_copy <= (45 if q_tile else 24), (per_copy, loop)
    assert compiled.resources["spill_stores"] == 0 and compiled.resources["spill_loads"] == 0


@pytest.fixture
def private_sources(tmp_path, monkeypatch):
    """A copy of cuda/ that the test may edit, and an empty cache directory, both under tmp_path."""
    src = tmp_path / "cuda"
    shutil.copytree(_compile.cuda_dir(), src)
    monkeypatch.setattr(_compile, "cuda_dir", lambda: src)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    _compile.source_hash.cache_clear()
    yield src
    _compile.source_hash.cache_clear()  # forget the copy's hash: later tests hash the real cuda/


def test_cache_key_follows_the_text_of_every_header(private_sources, monkeypatch):
    nvrtc_or_skip()
    cache = _compile.cache_dir()
    name = fwd_config(64, "fp16", False).cpp_name()

    first = _compile.compile_kernel(name, "sm_80")
    entries = sorted(p.name for p in cache.glob("*.json"))
    assert len(entries) == 1, entries

    # the same sources: served from the cache, NVRTC is not called
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again although the sources did not change")

    with monkeypatch.context() as m:
        m.setattr(_compile._nvrtc(), "createProgram", no_compile)
        again = _compile.compile_kernel(name, "sm_80")
    assert again.cubin == first.cubin and again.lowered_name == first.lowered_name

    # an edit in a header that kernels.cu only includes indirectly gives a new key and a new entry
    header = private_sources / "softmax.cuh"
    header.write_text(header.read_text() + "\n// an edit\n")
    _compile.source_hash.cache_clear()
    _compile.compile_kernel(name, "sm_80")
    after = sorted(p.name for p in cache.glob("*.json"))
    assert len(after) == 2 and entries[0] in after, after


def test_cache_key_differs_per_arch(private_sources):
    nvrtc_or_skip()
    name = fwd_config(64, "fp16", False).cpp_name()
    _compile.compile_kernel(name, "sm_80")
    _compile.compile_kernel(name, "sm_90a")
    assert len(list(_compile.cache_dir().glob("*.json"))) == 2


def test_compile_error_names_the_kernel(private_sources):
    nvrtc_or_skip()
    bad = "cuflash::fwd_kernel<cuflash::FwdTraits<100, 128, 64, 8, 2, cuflash::f16>, false>"  # 100 % 16 != 0
    with pytest.raises(RuntimeError, match="NVRTC failed to compile"):
        _compile.compile_kernel(bad, "sm_80", use_cache=False)


SAMPLE_LOG = """\
ptxas info    : 134 bytes gmem
ptxas info    : Compiling entry function '_ZN7cuflash10fwd_kernelE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cuflash10fwd_kernelE
ptxas         .     24 bytes stack frame, 16 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 331.834 ms
"""


def test_parse_ptxas_log():
    assert _compile.parse_ptxas_log(SAMPLE_LOG) == {
        "registers": 255, "spill_stores": 16, "spill_loads": 20, "stack": 24, "static_smem": 2048,
        "wgmma_advisories": [], "wgmma_serialized": []}
    clean = SAMPLE_LOG.replace("24 bytes stack frame, 16 bytes spill stores, 20 bytes spill loads",
                               "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    clean = clean.replace(", 2048 bytes smem", "")
    assert _compile.parse_ptxas_log(clean) == {
        "registers": 255, "spill_stores": 0, "spill_loads": 0, "stack": 0, "static_smem": 0, "wgmma_advisories": [],
        "wgmma_serialized": []}


# ptxas's advisories when it gives up a wgmma overlap (the first as NVRTC 13.5 printed it for a forward kernel with an
# early return between a wgmma and its wait; the second as ptxas words a serialization)
ADVISORIES = """\
ptxas info    : (C7517) wgmma.wait_group is injected in around line 2593 by compiler to allow use of registers defined \
by GMMA in function '_ZN7cuflash19fwd_sm90_fp8_kernel'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function \
'_ZN7cuflash19bwd_sm90_tf32_kernel'
"""


def test_parse_ptxas_log_reads_the_wgmma_advisories():
    """A kernel whose wgmma ptxas serialized is a compile-check problem (flag WGMMA-SERIALIZED-C75xx); an injected
    wait is listed beside the row."""
    res = _compile.parse_ptxas_log(SAMPLE_LOG + ADVISORIES)
    assert res["wgmma_advisories"] == ["C7515", "C7517"]
    assert res["wgmma_serialized"] == ["C7515"]
    assert res["registers"] == 255
    # other C-coded ptxas remarks are not wgmma advisories
    assert _compile.parse_ptxas_log(SAMPLE_LOG + "ptxas info    : (C7999) something else entirely\n")[
        "wgmma_advisories"] == []


def test_hopper_kernels_use_warpgroup_mma():
    """The sm_90a kernels must really run on wgmma (HGMMA in SASS is what makes them fast); their PTX
    says wgmma.mma_async, and a compile for sm_80 is refused by the kernel's own static_assert."""
    nvrtc_or_skip()
    name = fwd_sm90_config(64, "bf16", False).cpp_name()
    nvrtc = _compile._nvrtc()
    source = (_compile.cuda_dir() / "kernels.cu").read_text()
    prog = nvrtc.createProgram(source, "kernels.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, list(_compile.BASE_OPTIONS) + ["-arch=compute_90a", f"-I{_compile.cuda_dir()}"])
        ptx = nvrtc.getPTX(prog).decode() if isinstance(nvrtc.getPTX(prog), bytes) else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    with pytest.raises(RuntimeError, match="compile it for sm_90a"):
        _compile.compile_kernel(name, "sm_80", use_cache=False)


def test_generated_wgmma_wrappers_are_up_to_date():
    """cuda/ptx_wgmma.cuh is written by tools/gen_ptx_wgmma.py; an edit of either must keep them equal."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "gen_ptx_wgmma.py"
    if not script.is_file():
        pytest.skip("tools/ is not part of this installation")
    spec = importlib.util.spec_from_file_location("gen_ptx_wgmma", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (_compile.cuda_dir() / "ptx_wgmma.cuh").read_text() == gen.render(), \
        "cuda/ptx_wgmma.cuh differs from what tools/gen_ptx_wgmma.py writes: run the script"
    # the kernels' static_asserts accept a tile size by cuda/traits.cuh is_wgmma_n: the N values the script generates
    import re

    body = re.search(r"constexpr bool is_wgmma_n\(int n\) \{(.*?)\}", (_compile.cuda_dir() / "traits.cuh").read_text(),
                     re.S).group(1)
    assert tuple(int(x) for x in re.findall(r"n == (\d+)", body)) == gen.NS, \
        "is_wgmma_n in cuda/traits.cuh must list tools/gen_ptx_wgmma.py's NS"


def test_split_cap_matches_the_merge_kernel():
    """The merge (cuda/fwd.cuh merge_split_row) keeps MAX_SPLITS splits' lse in registers: the API's cap on
    num_splits must be that number."""
    import re

    from cuflash import _families, _validate

    found = re.search(r"constexpr int MAX_SPLITS = (\d+);", (_compile.cuda_dir() / "fwd.cuh").read_text())
    assert found and int(found.group(1)) == _families.MAX_SPLITS == _validate.MAX_SPLITS


def test_pre_sm90_tables_keep_sm90a_tiles_unchanged():
    """The sm_80-sm_89 backward tiles with heavy modifiers differ only where the sm_90a ones spilled there; the
    sm_90a choice (what the H100 runs and was measured) is the shared table."""
    for hd in config.KERNEL_HEAD_DIMS:
        for m in (config.MOD_BIAS, config.MODS_ALL):
            assert config.bwd_config(hd, "bf16", False, False, m, "sm_90a") == config.bwd_config(hd, "bf16", False, False, m)
            pre = config.bwd_config(hd, "bf16", False, False, m, "sm_80")
            assert (pre.block_m, pre.block_n, pre.num_warps, pre.d_split) == config.BWD_TILES_MODS_PRE_SM90[hd]
    assert not config.dq_supported(256, config.MOD_WINDOW | config.MOD_BIAS, "sm_80")
    assert config.dq_supported(256, config.MOD_WINDOW | config.MOD_BIAS, "sm_90a")
    assert config.dq_supported(256, config.MOD_BIAS, "sm_80") and config.dq_supported(128, config.MODS_ALL, "sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_shipped_tile_fits_the_targets_shared_memory(arch):
    """A CTA may have 227 KiB of shared memory on sm_90 but 163 KiB on an A100: every kernel the library launches
    on a target fits that target (the sm_90a float64 and TF32 tiles that do not fit an A100 have sm_80 ones)."""
    configs = config.all_fwd_configs(arch) + config.all_bwd_configs(arch)
    over = [c for c in configs if getattr(c, "smem_bytes", 0) > config.smem_limit(arch)]
    assert not over, over
    wide_sm80 = {c for c in config.all_wide_configs("sm_80")}
    wide_sm90 = {c for c in config.all_wide_configs("sm_90a")}
    assert wide_sm80 != wide_sm90  # the A100 ones differ where the H100 tiles are too large for it
    for c in wide_sm90 - wide_sm80:
        assert config.SMEM_LIMIT_SM80 < c.smem_bytes <= config.SMEM_LIMIT_SM90, c
    assert config.select("forward", 128, "fp64", False, "sm_80").smem_bytes <= config.SMEM_LIMIT_SM80
    assert config.select("backward", 64, "fp64", True, "sm_80").smem_bytes <= config.SMEM_LIMIT_SM80


def test_every_mods_listing_covers_the_lighter_sets():
    """`cuflash compile --every-mods` lists the main kernels of every modifier set the registry can pick, beyond the
    shipped list's heaviest sets: a lighter set of the head-dim-64 warp-specialized backward (a mask, deterministic)
    that the shipped list does not build, the head-dim-128 mask kernel it does, each listed once, each what `select`
    returns for its set, and the deterministic dQ kernel where one runs after the main kernel."""
    from cuflash.__main__ import every_mods_instantiations, shipped_instantiations

    every = every_mods_instantiations("sm_90a")
    names = [cfg.cpp_name() for _, cfg in every]
    assert len(names) == len(set(names))
    shipped = {cfg.cpp_name() for _, cfg in shipped_instantiations("sm_90a")}
    light = config.select("backward", 64, "bf16", False, "sm_90a", mods=config.MOD_MASK, deterministic=True)
    assert isinstance(light, config.BwdSm90WsConfig) and light.cpp_name() in names and light.cpp_name() not in shipped
    mask128 = config.select("backward", 128, "fp16", True, "sm_90a", mods=config.MOD_MASK | config.MOD_ALIBI)
    assert mask128.cpp_name() in names and mask128.cpp_name() in shipped
    det128 = config.select("backward", 128, "bf16", False, "sm_90a", mods=config.MOD_MASK, deterministic=True)
    assert not config.ordered_dq(det128) and config.dq_config(128, "bf16", False, config.MOD_MASK).cpp_name() in names
    # the wide-head backward, deterministic: at head dim 192 bwd_dq_kernel after it, with each modifier set (its lighter
    # sets spill); at 256 it adds dQ itself in turns (config.BWD_SM90_SPLIT_ORDERED), its ordered kernel listed
    split = config.select("backward", 192, "bf16", False, "sm_90a", mods=config.MOD_ALIBI, deterministic=True)
    assert isinstance(split, config.BwdSm90SplitConfig) and not config.ordered_dq(split)
    assert config.dq_config(192, "bf16", False, config.MOD_ALIBI).cpp_name() in names
    split256 = config.select("backward", 256, "bf16", False, "sm_90a", mods=config.MOD_ALIBI, deterministic=True)
    assert isinstance(split256, config.BwdSm90SplitConfig) and config.ordered_dq(split256)
    assert split256.cpp_name() in names and split256.cpp_name().endswith(", true>")
    for mods in (0, config.MOD_WINDOW, config.MOD_SOFTCAP | config.MOD_DROPOUT, config.MOD_BLOCKS):
        fwd = config.select("forward", 96, "fp16", False, "sm_90a", mods=mods)
        assert fwd.cpp_name() in names, mods


def test_every_mods_compile_check_on_one_kernel(capsys):
    """The compile command with --every-mods and a filter that leaves one kernel builds it and reports 0 problems."""
    nvrtc_or_skip()
    from cuflash.__main__ import main

    name = config.select("backward", 128, "bf16", False, "sm_90a", mods=config.MOD_MASK).cpp_name()
    assert main(["compile", "--every-mods", "--filter", name, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiling 1 kernel instantiations" in out and "1 kernels in" in out and "0 with problems" in out, out


@pytest.mark.parametrize("advisory,problem", [("C7515", True), ("C7517", False)])
def test_compile_check_fails_on_serialized_wgmma(advisory, problem, monkeypatch, capsys):
    """A ptxas advisory that it serialized a kernel's wgmma makes `cuflash compile` exit 1 (WGMMA-SERIALIZED-C7515);
    an injected wait is printed beside the row and is not a problem. (The log of one real compile, with the
    advisory's line added.)"""
    nvrtc_or_skip()
    from cuflash.__main__ import main

    name = config.select("forward", 128, "bf16", False, "sm_90a").cpp_name()
    real = _compile.compile_kernel
    line = [x for x in ADVISORIES.splitlines(keepends=True) if advisory in x][0]

    def with_advisory(expr, arch, use_cache=True):
        c = real(expr, arch, use_cache=use_cache)
        return _compile.Compiled(c.name_expression, c.lowered_name, c.arch, c.cubin, c.log + line)

    monkeypatch.setattr(_compile, "compile_kernel", with_advisory)
    assert main(["compile", "--filter", name, "--jobs", "1"]) == (1 if problem else 0)
    out = capsys.readouterr().out
    if problem:
        assert "WGMMA-SERIALIZED-C7515" in out and "1 with problems" in out, out
    else:
        assert "(ptxas C7517)" in out and "0 with problems" in out, out


def _sass(lines: list) -> str:
    """A SASS listing in nvdisasm's layout from (opcode and operands) lines and '.L_x_N:' labels."""
    return "\n".join(x if x.endswith(":") else f"        /*{16 * i:04x}*/                   {x} ;"
                     for i, x in enumerate(lines))


def test_sass_check_finds_overwritten_loop_invariant_a_registers():
    """`cuflash compile --sass` flags a warpgroup MMA whose register A operand is loaded from shared memory before a
    loop and written inside it (what NVRTC 13.0's ptxas did to one refused TF32 dQ kernel); A operands computed in
    the loop (P, dS: written before the MMA or carried to the next iteration), and writes after the loop, pass."""
    from cuflash.__main__ import sass_clobbered_a_operands

    load = [f"LDS R{88 + i}, [R{24 + i}+UR11]" for i in range(4)]
    mma = "HGMMA.64x64x8.F32.TF32 R56, R88, gdesc[UR16], RZ, !UPT"
    clobbered = _sass(load + [".L_x_1:", mma, "FADD R24, R56, R57", "MOV R89, 0x1", "@!P0 BRA `(.L_x_1)", "EXIT"])
    found = sass_clobbered_a_operands(clobbered)
    assert len(found) == 1 and found[0].startswith("R89,") and "MOV R89, 0x1" in found[0], found
    # a 64-bit load over R90, R91 inside the loop: both
    wide = _sass(load + [".L_x_1:", mma, "LDG.E.64 R90, desc[UR4][R2.64]", "@!P0 BRA `(.L_x_1)"])
    assert [f.split(",")[0] for f in sass_clobbered_a_operands(wide)] == ["R90", "R91"]
    # the same writes after the loop, or registers the loop computes (P of the previous key tile): nothing
    after = _sass(load + [".L_x_1:", mma, "@!P0 BRA `(.L_x_1)", "MOV R89, 0x1", "EXIT"])
    carried = _sass([f"F2FP R{88 + i}, R{8 + i}, R{9 + i}" for i in range(4)]
                    + [".L_x_1:", mma, "F2FP R88, R10, R11", "@!P0 BRA `(.L_x_1)"])
    in_loop = _sass(load + [".L_x_1:", "F2FP R88, R10, R11", mma, "@!P0 BRA `(.L_x_1)"])
    assert sass_clobbered_a_operands(after) == sass_clobbered_a_operands(carried) == []
    assert sass_clobbered_a_operands(in_loop) == []


def test_page_divisor_formula_is_integer_division():
    """cuda/fwd.cuh PageDivisor: key / d as (key * m) >> (31 + s), s = ceil(log2 d), m = floor(2^(31+s) / d) + 1,
    for every page size the library takes (multiples of 16) and every key below 2^31: the formula, at the edges of
    each quotient, at the largest keys and at random ones, against Python's integer division."""
    src = (_compile.cuda_dir() / "fwd.cuh").read_text()
    assert "shift(31 + 32 - __clz(d - 1))" in src and "(1ull << shift) / static_cast<u32>(d)) + 1u" in src
    rng = np.random.default_rng(0)
    sizes = list(range(16, 4097, 16)) + [16 * 12345, 48 * 1021, 1 << 20, (1 << 31) - 16, 1 << 30]
    for d in sizes:
        shift = 31 + (d - 1).bit_length()  # 32 - __clz(d - 1) = bits of d - 1 = ceil(log2 d)
        mul = (1 << shift) // d + 1
        assert mul < 1 << 32, d
        top = (1 << 31) - 1
        keys = [0, 1, d - 1, d, d + 1, top, top - 1, top - top % d, top - top % d - 1]
        keys += [int(k) for k in rng.integers(0, 1 << 31, 200)]
        q = np.arange(0, min(top // d, 3000) + 1, dtype=np.int64)
        keys += [int(k) for k in np.concatenate([q * d, q * d - 1, q * d + d - 1]) if 0 <= k <= top]
        bad = [k for k in keys if (k * mul) >> shift != k // d]
        assert not bad, (d, bad[:5])


def test_wide_forward_stages_set_the_shared_memory_and_the_kernel_name():
    """FwdWideConfig.stages: the buffers of K and V (cuda/wide.cuh WideFwdTraits' STAGES), in the kernel name and the
    shared memory; only 1 and 2 exist."""
    two = config.FwdWideConfig(128, 128, 16, 8, "fp64", False)
    one = config.FwdWideConfig(128, 128, 32, 8, "fp64", False, 0, 1, 1)
    row = (128 + config.WIDE_PITCH_PAD) * 8
    assert two.stages == 2 and two.smem_bytes == 128 * row + 2 * 16 * 2 * row
    assert one.smem_bytes == 128 * row + 32 * 2 * row == two.smem_bytes
    assert "cuflash::F64, 1, 2>" in two.cpp_name() and "cuflash::F64, 1, 1>" in one.cpp_name()
    with pytest.raises(ValueError, match="stages=3: 1 or 2"):
        config.FwdWideConfig(128, 128, 16, 8, "fp64", False, 0, 1, 3)
