"""The fwd_sm90_ws_kernel instantiations the direct-launch tests build (tests/test_fwd_ws_compile.py without a GPU,
tests/test_gpu_fwd_ws.py on one). No CuPy needed."""
from __future__ import annotations

from cuflash import config

# Heavy score modifiers have no pingpong variant at any head dim: with it, d256 block_n 32 kept 4-8 bytes on the
# stack, d64 block_n 128 8 bytes once the bias and the mask were modifiers, d128 block_n 96 44 bytes once the
# consumers staged the bias and mask rows (NVRTC 13.5); the library runs them without it
# (config.FWD_SM90_WS_TILES_MODS)
WS_NO_PINGPONG_MODS = (64, 128, 256)


def ws_kernel(head_dim: int, dtype: str, causal: bool, mods: int = 0, pingpong: bool = True) -> config.FwdSm90WsConfig:
    """The instantiation of (head dim, dtype, causal, MODS) on the library's tiles, with or without pingpong
    (never with it where WS_NO_PINGPONG_MODS says so)."""
    pingpong = pingpong and not (config.heavy_mods(mods) and head_dim in WS_NO_PINGPONG_MODS)
    return config.fwd_sm90_ws_config(head_dim, dtype, causal, mods, pingpong)
