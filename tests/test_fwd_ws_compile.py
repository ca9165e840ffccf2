"""The warp-specialized Hopper forward (cuda/fwd_sm90_ws.cuh) without a GPU: every instantiation compiles through
NVRTC for sm_90a spill-free, with setmaxnreg honoured (no ptxas warning C7508) and wgmma kept asynchronous (no
serialization warning); its SASS holds the TMA loads and warpgroup MMAs; the params struct that Python fills
(cuflash/_tma.py) has the layout the C++ static_asserts; the host-side TMA argument checks accept and reject the
strides they should."""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
from types import SimpleNamespace

import pytest

from cuflash import _compile, _launch, _tma, config

CONFIGS = [config.fwd_sm90_ws_config(d, dt, c, pingpong=pp)
           for d, dt, c, pp in itertools.product(config.FWD_SM90_WS_TILES, ("fp16", "bf16"), (False, True), (False, True))]


def _nvrtc_or_skip():
    try:
        _compile._nvrtc().getVersion()
    except Exception as e:  # CuPy or libnvrtc missing: nothing to compile with
        pytest.skip(f"NVRTC is not usable here: {type(e).__name__}: {e}")


def _nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe is None:
        try:
            import nvidia.cu13

            cand = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "nvdisasm")
            exe = cand if os.path.isfile(cand) else None
        except ImportError:
            exe = None
    return exe


def _name(cfg):
    return f"d{cfg.head_dim}-{cfg.dtype}-{'causal' if cfg.causal else 'full'}-{'pingpong' if cfg.pingpong else 'plain'}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_name)
def test_every_instantiation_compiles_spill_free(cfg):
    _nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    res = compiled.resources
    spills = (res["spill_stores"], res["spill_loads"], res["stack"])
    assert spills == (0, 0, 0), f"{cfg} spills (stores, loads, stack) = {spills}\n{compiled.log}"
    # 384 threads at 1 CTA per SM: ptxas allots 168 at launch; setmaxnreg moves them to the consumers
    assert res["registers"] is not None and res["registers"] <= 168, f"{cfg}: {res}"
    assert "C7508" not in compiled.log, f"{cfg}: ptxas ignored setmaxnreg\n{compiled.log}"
    assert "serialized" not in compiled.log, f"{cfg}: ptxas serialized the wgmma\n{compiled.log}"
    assert res["static_smem"] + cfg.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.dtype == "bf16" and not c.causal], ids=_name)
def test_sass_has_tma_loads_and_async_wgmma(cfg):
    _nvrtc_or_skip()
    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin + b"\0" * 8)  # CuPy's getCUBIN drops the last byte; nvdisasm wants it
        f.flush()
        text = subprocess.run([exe, "-c", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)", text, re.M)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
    panels = cfg.head_dim // 64
    assert count("UTMALDG") == 3 * panels, f"{cfg}: {count('UTMALDG')} TMA loads, want Q, K, V x {panels} panels"
    assert count("HGMMA") > 0 and count("USETMAXREG") == 2, f"{cfg}: HGMMA {count('HGMMA')}, USETMAXREG {count('USETMAXREG')}"
    assert count("LDL") == 0 and count("STL") == 0, f"{cfg} touches local memory"
    # the P V GEMM stays in flight during the softmax: a wait that leaves one group pending
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", text), f"{cfg}: no wgmma.wait_group 1 in the SASS"


def test_params_layout_matches_the_kernel():
    # cuda/fwd_sm90_ws.cuh static_asserts the same numbers (offsets 0, 128, 256, 384; 768 bytes)
    import ctypes

    assert ctypes.sizeof(_tma.FwdWsParams) == 768
    assert [getattr(_tma.FwdWsParams, f).offset for f in ("tma_q", "tma_k", "tma_v", "fwd")] == [0, 128, 256, 384]
    assert _tma.FwdWsParams.fwd.size == ctypes.sizeof(_launch.FwdParams) == 328
    src = (_compile.cuda_dir() / "fwd_sm90_ws.cuh").read_text()
    assert "sizeof(FwdWsParams) == 768" in src and "alignof(FwdParams) == 8 && sizeof(FwdParams) == 328" in src


def test_config_names_and_shared_memory():
    cfg = config.fwd_sm90_ws_config(128, "bf16", True, pingpong=True)
    assert cfg.cpp_name() == ("cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<128, 128, 2, true, cuflash::bf16>, "
                              "true>")
    assert cfg.threads == 384 and cfg.grid(2, 3, 257) == (3, 3, 2)
    # Q 32 KB + 2 stages x (K + V) 32 KB each + 9 mbarriers + 1 KB alignment slack
    assert cfg.smem_bytes == 32768 + 4 * 32768 + 72 + 1024
    with pytest.raises(ValueError, match="head_dim=96"):
        config.fwd_sm90_ws_config(96, "bf16", False)


def _dims(b, s, h, d, bs, rs, hs):
    return SimpleNamespace(batch=b, seqlen=s, heads=h, head_dim=d, batch_stride=bs, row_stride=rs, head_stride=hs)


def test_tma_argument_rules():
    b, s, h, d = 2, 100, 3, 128
    bshd = _dims(b, s, h, d, s * h * d, h * d, d)
    bhsd = _dims(b, s, h, d, h * s * d, d, s * d)
    assert _tma.tma_unsupported(0x10000, bshd, "bf16") is None
    assert _tma.tma_unsupported(0x10000, bhsd, "fp16") is None
    # head stride d + 4 elements = 264 bytes: not a multiple of 16
    assert "strides" in _tma.tma_unsupported(0x10000, _dims(b, s, h, d, s * h * (d + 4), h * (d + 4), d + 4), "bf16")
    assert "aligned" in _tma.tma_unsupported(0x10008, bshd, "bf16")
    # a size-1 dim with stride 0 (CuPy broadcast) is harmless
    assert _tma.tma_unsupported(0x10000, _dims(1, s, h, d, 0, h * d, d), "bf16") is None
    with pytest.raises(ValueError, match="128-byte swizzle"):
        _tma.encode_tiled("bf16", 0x10000, (128, 100), (256,), (128, 64))
