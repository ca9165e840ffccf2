"""cuflash: FlashAttention for CuPy, and an IO analyzer that counts why it is fast.

    import cupy as cp, cuflash
    o = cuflash.attention(q, k, v, causal=True)       # q, k, v: (batch, seqlen, heads, head_dim) fp16/bf16
    q8, qd = cuflash.fp8.quantize(q)                  # FP8 (e4m3) inputs for the Hopper FP8 forward
"""
from pathlib import Path as _Path

# In a source checkout the CUDA sources and the analyzer live beside this package (cuda/, simulator/);
# an installed wheel maps them to cuflash/cuda and cuflash/simulator. Make both spellings import.
_here = _Path(__file__).resolve().parent
if not (_here / "simulator").is_dir() and (_here.parent / "simulator" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (module __path__)

__version__ = "0.1.0"

from .blockmask import BlockMask  # noqa: E402
from . import fp8  # noqa: E402  (cuflash.fp8.quantize, .hadamard, ...: FP8 inputs; compiles nothing on import)
from .api import (attention, attention_backward, attention_forward, attention_varlen,  # noqa: E402
                  attention_varlen_backward, attention_varlen_forward, attention_with_kvcache)

__all__ = ["BlockMask", "fp8", "attention", "attention_forward", "attention_backward", "attention_varlen", "attention_varlen_forward",
           "attention_varlen_backward", "attention_with_kvcache", "__version__"]
