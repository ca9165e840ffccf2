"""Run-time compilation of cuda/ through NVRTC, with a disk cache keyed on every source file.

One cubin per kernel instantiation (a name expression such as
`cuflash::fwd_kernel<cuflash::FwdTraits<128, 128, 64, 8, 2, cuflash::bf16>, false>`), so the first
call of a configuration compiles only what it needs. The cache key hashes the text of every file in
cuda/, the NVRTC version, the architecture, the options and the name expression: an edited header can
never serve a stale kernel (CuPy's own cache would miss headers pulled in with -I).

This module needs NVRTC but no GPU: `python -m cuflash compile` uses it in CI.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent
BASE_OPTIONS = ("-std=c++17", "-default-device", "-DNDEBUG")


def cuda_dir() -> Path:
    """cuda/ sources: cuflash/cuda in an installed wheel, ../cuda in a source checkout."""
    for d in (_HERE / "cuda", _HERE.parent / "cuda"):
        if (d / "kernels.cu").is_file():
            return d
    raise FileNotFoundError(f"cuflash's CUDA sources (kernels.cu) are in neither {_HERE / 'cuda'} nor {_HERE.parent / 'cuda'}")


@lru_cache(maxsize=None)
def source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(cuda_dir().iterdir()):
        if f.suffix in (".cu", ".cuh"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("CUFLASH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cuflash")
    return Path(root)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("cuflash needs CuPy (pip install 'cuflash[cuda13]' or 'cuflash[cuda12]')") from e
    return nvrtc


@dataclass(frozen=True)
class Compiled:
    name_expression: str
    lowered_name: str
    arch: str
    cubin: bytes
    log: str

    @property
    def resources(self) -> dict:
        """Registers, spill bytes, stack and static shared memory, from ptxas -v."""
        return parse_ptxas_log(self.log)


# ptxas's performance advisories on warpgroup MMA: "(C7515) Potential Performance Loss: wgmma.mma_async instructions
# are serialized due to ..." (C7510-C7516, by cause) takes away every overlap of the kernel's wgmma, with no other sign
# than its speed; "(C7517) wgmma.wait_group is injected in around line N ..." adds one wait, which costs little where
# it lands after a loop (where ptxas cannot prove the loop's last wait retired every group) but would in a loop
WGMMA_ADVISORY = re.compile(r"\((C75\d\d)\)[^\n]*wgmma", re.IGNORECASE)
WGMMA_SERIALIZED = re.compile(r"\((C75\d\d)\)[^\n]*wgmma[^\n]*serialized", re.IGNORECASE)


def parse_ptxas_log(log: str) -> dict:
    """Registers, spill bytes, stack and static shared memory from ptxas -v, and its wgmma advisories: the codes of
    all of them in `wgmma_advisories` (e.g. ["C7517"]), of those that serialized wgmma in `wgmma_serialized`."""
    out = {"registers": None, "spill_stores": 0, "spill_loads": 0, "stack": 0, "static_smem": 0,
           "wgmma_advisories": sorted(set(WGMMA_ADVISORY.findall(log))),
           "wgmma_serialized": sorted(set(WGMMA_SERIALIZED.findall(log)))}
    if m := re.search(r"Used (\d+) registers", log):
        out["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    if m := re.search(r"(\d+) bytes smem", log):
        out["static_smem"] = int(m.group(1))
    return out


def compile_kernel(name_expression: str, arch: str, *, use_cache: bool = True) -> Compiled:
    """Compile one instantiation of cuda/kernels.cu for `arch` ("sm_80", "sm_90a", ...)."""
    nvrtc = _nvrtc()
    options = BASE_OPTIONS + (f"-arch={arch}", f"-I{cuda_dir()}", "--ptxas-options=-v")
    key = hashlib.sha256(json.dumps(
        [source_hash(), list(nvrtc.getVersion()), arch, options[:-2], name_expression]).encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.json"
    if use_cache and path.is_file():
        try:
            meta = json.loads(path.read_text())
            cubin = path.with_suffix(".cubin").read_bytes()
            return Compiled(name_expression, meta["lowered_name"], arch, cubin, meta["log"])
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is recompiled

    source = (cuda_dir() / "kernels.cu").read_text()
    prog = nvrtc.createProgram(source, "kernels.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed to compile {name_expression} for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, name_expression)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)

    compiled = Compiled(name_expression, lowered, arch, bytes(cubin), log)
    if use_cache:
        _write_cache(path, compiled)
    return compiled


def _write_cache(path: Path, c: Compiled) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # write-then-rename: concurrent processes never see half a file
        for suffix, data in ((".cubin", c.cubin), (".json", json.dumps({"lowered_name": c.lowered_name, "log": c.log}).encode())):
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path.with_suffix(suffix))
    except OSError:
        pass  # a read-only home still works, it just compiles every time


def device_arch(device_id: int | None = None) -> str:
    """NVRTC architecture for a device: sm_90a on Hopper (wgmma-capable), sm_XY otherwise."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    cc = int(dev.compute_capability)
    if cc < 80:
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        raise RuntimeError(f"cuflash needs a GPU of compute capability 8.0 or newer (tensor-core mma.sync m16n8k16 "
                           f"with bf16); device {dev.id} ({name}) is sm_{cc}")
    return "sm_90a" if cc == 90 else f"sm_{cc}"
