// kernels.cu: the one translation unit NVRTC compiles. The Python side (cuflash/_compile.py) asks
// for each template instance by name expression, e.g.
//   cuflash::fwd_kernel<cuflash::FwdTraits<128, 128, 64, 8, 2, cuflash::bf16>, false>
// The *_sm90 kernels (wgmma) are asked for only when compiling for sm_90a.
#include "fwd.cuh"
#include "bwd.cuh"
#include "fwd_sm90.cuh"
#include "fwd_sm90_ws.cuh"
#include "bwd_sm90.cuh"
#include "bwd_sm90_ws.cuh"
#include "fwd_sm90_fp8.cuh"
#include "fwd_sm90_tf32.cuh"
#include "bwd_sm90_tf32.cuh"
#include "bwd_sm90_split.cuh"
#include "kvcache.cuh"
#include "wide.cuh"
