"""Shared test setup: GPU tests (marker `gpu`) are skipped, with the reason, where no CUDA GPU is usable."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_status() -> tuple[bool, str]:
    """(usable, why not): cupy importable and cupy.is_available() True."""
    try:
        import cupy
    except ImportError as e:
        return False, f"CuPy is not importable ({e}); install cuflash[cuda13] or cuflash[cuda12]"
    try:
        if cupy.is_available():
            return True, ""
    except Exception as e:  # a broken driver install: report it, do not crash collection
        return False, f"cupy.is_available() raised {type(e).__name__}: {e}"
    return False, "no CUDA GPU: cupy.is_available() is False (run `python -m pytest -m gpu` on a GPU machine)"


@functools.lru_cache(maxsize=None)
def multigpu_status() -> tuple[bool, str]:
    """(usable, why not): two or more GPUs and NCCL loadable by CuPy."""
    usable, reason = gpu_status()
    if not usable:
        return False, reason
    import cupy
    from cupy.cuda import nccl

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        return False, f"needs two or more GPUs; this machine has {count}"
    if not nccl.available:
        return False, "CuPy cannot load NCCL: pip install 'cuflash[distributed]'"
    return True, ""


def pytest_collection_modifyitems(config, items):
    multi = [item for item in items if "multigpu" in item.keywords]
    if multi:
        usable, reason = multigpu_status()
        for item in multi if not usable else ():
            item.add_marker(pytest.mark.skip(reason=reason))
    gpu_items = [item for item in items if "gpu" in item.keywords or "gpu_slow" in item.keywords]
    if not gpu_items:
        return
    usable, reason = gpu_status()
    slow_selected = "gpu_slow" in (config.getoption("markexpr", "") or "")
    for item in gpu_items:
        if not usable:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif "gpu_slow" in item.keywords and not slow_selected:
            item.add_marker(pytest.mark.skip(reason="long GPU sweep: select it with -m gpu_slow"))
