"""cuflash: FlashAttention for CuPy, and an IO analyzer that counts why it is fast.

    import cupy as cp, cuflash
    o = cuflash.attention(q, k, v, causal=True)       # q, k, v: (batch, seqlen, heads, head_dim) fp16/bf16
"""
from pathlib import Path as _Path

# In a source checkout the CUDA sources and the analyzer live beside this package (cuda/, simulator/);
# an installed wheel maps them to cuflash/cuda and cuflash/simulator. Make both spellings import.
_here = _Path(__file__).resolve().parent
if not (_here / "simulator").is_dir() and (_here.parent / "simulator" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821  (module __path__)

__version__ = "0.1.0"

from .blockmask import BlockMask  # noqa: E402
from .api import (attention, attention_backward, attention_forward, attention_varlen,  # noqa: E402
                  attention_varlen_backward, attention_varlen_forward, attention_with_kvcache)

__all__ = ["BlockMask", "attention", "attention_forward", "attention_backward", "attention_varlen", "attention_varlen_forward",
           "attention_varlen_backward", "attention_with_kvcache", "__version__"]
