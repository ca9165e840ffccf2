// ptx.cuh: the only hand-written file with inline assembly (its generated companion, ptx_wgmma.cuh,
// holds the wgmma.mma_async wrappers). Each wrapper is named after its PTX instruction and cites the
// section of the PTX ISA (version 8.x) that defines it. No host headers: NVRTC compiles this.
#pragma once

namespace cuflash {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// Element-type tags. Storage is 16-bit (e4m3: 8-bit, the FP8 forward; tf32: float32, the float32 forward on
// Hopper); the tags select the mma / cvt variants.
struct f16 {};
struct bf16 {};
struct e4m3 {};
struct tf32 {};  // float32 values read as TF32 by the tensor cores (wgmma .tf32)

// ---- shared-memory address -------------------------------------------------------------------
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ---- cp.async (PTX ISA 9.7.9.25.3.1 "cp.async") ------------------------------------------------
// 16 bytes global -> shared, bypassing L1 (.cg). src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_cg_16(u32 dst_smem, const void* src_gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src_gmem), "r"(src_bytes));
}
// ... src_bytes (0..16) read, the rest of the 16 bytes zero-filled
__device__ __forceinline__ void cp_async_cg_16_n(u32 dst_smem, const void* src_gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem), "l"(src_gmem), "r"(src_bytes));
}
// PTX ISA 9.7.9.25.3.2 "cp.async.commit_group"
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;\n" ::); }
// PTX ISA 9.7.9.25.3.3 "cp.async.wait_group": wait until at most N groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- ldmatrix (PTX ISA 9.7.14.5.15 "ldmatrix") -----------------------------------------------
// .x4: lanes 8m..8m+7 give the 8 row addresses (16 bytes each) of matrix m; r[m] is this lane's
// 32-bit piece of matrix m (row lane/4, columns 2*(lane%4), +1; transposed with .trans).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// ---- stmatrix (PTX ISA 9.7.14.5.16 "stmatrix", sm_90): the store counterpart of ldmatrix .x4: lanes 8m..8m+7
// give the row addresses of matrix m, and each lane's r[m] lands at row lane/4, columns 2*(lane%4), +1 of it.
// (compiled only for sm_90 and later: the same translation unit is also built for sm_80, where it traps)
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---- mma (PTX ISA 9.7.14.5.14 "mma", shape m16n8k16, fp32 accumulate) -------------------------
// a: 4 regs (rows g, g+8; k 2t..2t+1 and 8+2t..), b: 2 regs (k 2t.., 8+2t..; column g),
// c: c0,c1 row g cols 2t,2t+1; c2,c3 row g+8. (g = lane/4, t = lane%4)
template <class T>
struct Mma;
template <>
struct Mma<f16> {
  static __device__ __forceinline__ void m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma<bf16> {
  static __device__ __forceinline__ void m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ---- cvt (PTX ISA 9.7.9.21 "cvt"): two fp32 -> packed 16-bit pair, round to nearest even -------
// The first source lands in the upper half: pack(lo, hi) puts `lo` at the lower address.
template <class T>
struct Cvt;
template <>
struct Cvt<f16> {
  static constexpr int BIAS_KIND = 1;  // ModParams::bias_kind of a bias in this dtype (mods.cuh)
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  }
  // element `hi` (0: lower address, 1: upper) of a pair packed by pack()
  static __device__ __forceinline__ float unpack(u32 pair, int hi) { return to_float(static_cast<u16>(pair >> (16 * hi))); }
};
template <>
struct Cvt<bf16> {
  static constexpr int BIAS_KIND = 2;
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(static_cast<u32>(x) << 16); }
  static __device__ __forceinline__ float unpack(u32 pair, int hi) {
    return __uint_as_float(hi ? (pair & 0xffff0000u) : (pair << 16));
  }
};

// ---- cvt to e4m3 (PTX ISA 9.7.9.21 "cvt", sm_89+): four fp32 -> four e4m3 in one 32-bit word, round to nearest
// even, saturated to +-448 (satfinite); x0 at the lowest byte. cvt.e4m3x2 puts its first source in the upper byte.
// (compiled only for sm_89 and later: the same translation unit is also built for sm_80, where it traps)
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
  u32 r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
#else
  __trap();
#endif
  return r;
}

// ---- prmt (PTX ISA 9.7.8.7 "prmt"): byte i of the result = byte (sel >> 4i) & 7 of the pair {b, a} (a: bytes 0-3)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// ---- TF32 and FP64 tensor-core mma (PTX ISA 9.7.14.5.14 "mma"): the float32 / float64 kernels (wide.cuh) ----
// c += a b, m16n8k8 TF32 inputs (float32 bit patterns; the low 13 mantissa bits are ignored), fp32 accumulators: a (16 x 8) rows g, g+8 x columns t, t+4; b (8 x 8) rows t, t+4
// x column g; c rows g, g+8 x columns 2t, 2t+1 (g = lane / 4, t = lane % 4)
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// c += a b, m8n8k4 float64 (the FP64 tensor cores, sm_80+): a (8 x 4) row g column t; b (4 x 8) row t column g;
// c row g, columns 2t, 2t+1
__device__ __forceinline__ void mma_m8n8k4_f64(double& c0, double& c1, double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(c0), "+d"(c1)
               : "d"(a), "d"(b));
}
// c += a b, m16n8kK float64, K = 4, 8 or 16 (sm_90+: one DMMA.16x8xK): a (16 x K) element i at row g + 8 (i & 1),
// column t + 4 (i >> 1); b (K x 8) element i at row t + 4 i, column g; c rows g, g+8 x columns 2t, 2t+1
template <int K>
__device__ __forceinline__ void mma_m16n8k_f64(double (&c)[4], const double (&a)[K / 2], const double (&b)[K / 4]) {
  static_assert(K == 4 || K == 8 || K == 16, "m16n8k4, m16n8k8, m16n8k16");
  if constexpr (K == 4)
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(b[0]));
  else if constexpr (K == 8)
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
        "{%12, %13, %14, %15}, {%0, %1, %2, %3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]),
          "d"(b[2]), "d"(b[3]));
}

// ---- ex2.approx (PTX ISA 9.7.4.9 "ex2"): 2^x, ex2(-inf) = +0 -----------------------------------
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- red.global.add.f32 (PTX ISA 9.7.13.7 "red"): fire-and-forget atomic add ----------------
__device__ __forceinline__ void red_add_f32(float* addr, float v) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(v));
}

// a plain store to global memory (st.global: from a float* the compiler cannot tell global, a generic store)
__device__ __forceinline__ void st_global_f32(float* addr, float v) {
  asm volatile("st.global.f32 [%0], %1;\n" ::"l"(addr), "f"(v) : "memory");
}

// Two adjacent floats in one request (PTX ISA 9.7.13.7, .v2.f32 needs sm_90); two scalar reds before.
__device__ __forceinline__ void red_add_v2_f32(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b));
#else
  red_add_f32(addr, a);
  red_add_f32(addr + 1, b);
#endif
}

// Four adjacent floats (16 bytes, aligned) in one request (PTX ISA 9.7.13.7, .v4.f32 needs sm_90); two .v2 before.
__device__ __forceinline__ void red_add_v4_f32(float* addr, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b), "f"(c), "f"(d));
#else
  red_add_v2_f32(addr, a, b);
  red_add_v2_f32(addr + 2, c, d);
#endif
}

// ---- mov (PTX ISA 9.7.9.10 "mov") as a volatile asm: values the compiler must not reuse ------------
// threadIdx.x read anew: addresses derived from it after a long loop are recomputed there instead of
// being kept live (or spilled) across the loop from the prologue's identical computation.
__device__ __forceinline__ int tid_x_reread() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}
// blockIdx.x and gridDim.x read anew, likewise
__device__ __forceinline__ int ctaid_x_reread() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ int nctaid_x_reread() {
  int v;
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(v));
  return v;
}
// x itself, but opaque to the optimizer: what is computed from the result after a long loop is computed
// there (a few integer ops) instead of being kept in registers through the loop.
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Ends ptxas's basic block here: a branch on a kernel argument that is never negative (`never_negative`, e.g. the
// head count) around a nanosleep that never runs. ptxas schedules a wgmma.wait_group at the top of its basic block,
// ahead of any arithmetic that does not depend on it: in the forward kernels the wait for the previous key tile's
// P V GEMM, written after the tile's softmax, lands ahead of the exponentials (SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0
// before the first MUFU.EX2), so the softmax runs after that GEMM rather than under it. The 3xTF32 forward calls
// this between the two (fwd_sm90_tf32.cuh); the other forward kernels keep ptxas's order, which measured as fast
// (docs/PERFORMANCE.md, "What did not pay"). (A __trap in the branch made ptxas spill 100-1400 bytes in most
// forward kernels; a __syncwarp on a mask computed from the softmax made it guard the row-max shuffles with
// divergence checks; a branch on a value ptxas can fold is folded away.)
__device__ __forceinline__ void end_basic_block(int never_negative) {
  if (never_negative < 0) asm volatile("nanosleep.u32 0;");
}

// ---- Hopper (sm_90a) warpgroup MMA: wgmma.* (PTX ISA 9.7.15) -------------------------------------
// Only the sm_90a kernels (fwd_sm90.cuh, bwd_sm90.cuh) call these; compiling them for another target
// fails in ptxas, and the Python side never asks for those kernels there.

// PTX ISA 9.7.15 (warpgroup MMA), "wgmma.fence": orders register accesses of the warpgroup before the following
// wgmma.mma_async (needed before the first one, and whenever its accumulators or A registers were written).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// PTX ISA 9.7.15, "wgmma.commit_group": the wgmma.mma_async issued so far form one group.
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// PTX ISA 9.7.15, "wgmma.wait_group": wait until at most N groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Not an instruction: tells the compiler that the accumulators may have changed (an async wgmma wrote
// them), so no read of them is moved above the wgmma_wait_group before it.
template <int ROWS, int COLS>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[ROWS][COLS]) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int j = 0; j < COLS; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}
// PTX ISA 9.7.13.4 "membar/fence": fence.acq_rel.gpu, the release (before a strong write such as an atomic)
// or acquire (after a strong read) half of a message passed between CTAs; lighter than fence.sc
// (__threadfence), which a release/acquire pattern does not need.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
// PTX ISA "ld" with .acquire.gpu: a strong read that later reads of this thread cannot pass (the acquire
// half of a message passed between CTAs, in one instruction).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// PTX ISA "red" with .release.gpu: adds v to *p after every earlier memory operation of this thread (the release
// half of a message passed between CTAs, in one instruction; the counter of an ordered reduction).
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Waits until the counter *p (written by other CTAs with red_release_gpu_add) equals v; a count that never comes
// (a wrong turn computed on either side) fails the launch after about 2^26 reads instead of hanging the GPU.
__device__ __forceinline__ void wait_counter_or_trap(const int* p, int v) {
  for (u32 tries = 0; ld_acquire_gpu(p) != v; ++tries)
    if (tries == (1u << 26)) __trap();
}
// PTX ISA "st" / "ld" on the .shared state space: one 32-bit word at a shared::cta address (ordered with the
// mbarrier operations around them by their "memory" clobber and the barriers' release / acquire semantics).
__device__ __forceinline__ void st_shared_s32(u32 addr, int v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_s32(u32 addr) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// PTX ISA 9.7.13.4 "membar/fence", fence.proxy.async: makes this thread's generic-proxy writes to shared memory
// (st.shared, cp.async) visible to the async proxy (wgmma operand reads) after the next barrier.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// ... on global memory: orders this thread's generic-proxy accesses to global memory (the acquire or release of a
// counter) with its async-proxy ones (cp.reduce.async.bulk into global memory), both ways.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// Matrix descriptor of a shared-memory operand (PTX ISA 9.7.15.5.1.2.2): start address, leading and
// stride byte offsets (all >> 4), swizzle mode in bits 62-63 (1: 128-byte, 2: 64-byte, 3: 32-byte).
// The swizzle pattern must start at a multiple of 8 * SWIZZLE_BYTES (base offset field 0).
template <int SWIZZLE_BYTES>
__device__ __forceinline__ u64 wgmma_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
  static_assert(SWIZZLE_BYTES == 128 || SWIZZLE_BYTES == 64 || SWIZZLE_BYTES == 32, "wgmma swizzle: 128, 64 or 32 bytes");
  constexpr u64 MODE = SWIZZLE_BYTES == 128 ? 1 : (SWIZZLE_BYTES == 64 ? 2 : 3);
  return static_cast<u64>((smem_addr & 0x3FFFF) >> 4) | (static_cast<u64>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<u64>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (MODE << 62);
}

// ---- Hopper (sm_90) asynchronous copies and barriers: mbarrier, TMA, setmaxnreg, named barriers ----------
// Used by the warp-specialized forward (fwd_sm90_ws.cuh). Barrier and tile addresses are shared::cta
// addresses (smem_u32), which are valid shared::cluster addresses of the executing CTA.

// PTX ISA 8.0+, "Parallel Synchronization and Communication Instructions: mbarrier.init": the barrier's phase 0 expects `count` arrivals (and no transaction bytes).
__device__ __forceinline__ void mbarrier_init(u32 bar_smem, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar_smem), "r"(count) : "memory");
}
// PTX ISA 8.0+, "membar/fence", fence.mbarrier_init: makes the preceding mbarrier.init of this thread visible
// to the other threads and to the async proxy (TMA's complete_tx) of the cluster; a CTA launched without a
// cluster is a cluster of one. Follow it with a barrier (__syncthreads) before any other thread uses the barriers.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// PTX ISA 8.0+, "mbarrier.arrive" with .expect_tx: this thread's arrival, plus `tx_bytes` more bytes that
// asynchronous copies must complete (complete_tx) before the phase can complete. Release semantics (.cta).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar_smem, u32 tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar_smem), "r"(tx_bytes) : "memory");
}
// PTX ISA 8.0+, "mbarrier.arrive": one arrival (release semantics, .cta).
__device__ __forceinline__ void mbarrier_arrive(u32 bar_smem) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar_smem) : "memory");
}
// PTX ISA 8.0+, "mbarrier.test_wait/mbarrier.try_wait" with .parity: waits (acquire semantics, .cta) until the phase
// of parity `parity` has completed: the current phase if its parity is `parity`, else the phase before it, which
// counts as completed (so a fresh barrier, in phase 0, passes a wait for parity 1 at once). try_wait suspends
// the thread for a time-limit chosen by the hardware and returns whether the phase completed (_once); the
// loop retries until it has.
__device__ __forceinline__ bool mbarrier_try_wait_parity_once(u32 bar_smem, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(bar_smem), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbarrier_try_wait_parity(u32 bar_smem, u32 parity) {
  while (!mbarrier_try_wait_parity_once(bar_smem, parity)) {
  }
}

// PTX ISA 8.0+, "Data Movement: cp.async.bulk.tensor" (TMA), tile mode, global -> shared: the box of the tensor map at
// `tensor_map` (a generic address: a __grid_constant__ kernel parameter, const or global memory) whose first
// element has coordinates {c0, c1, ...} (c0: the innermost dimension, in elements) into dst_smem, laid out
// as the map says (e.g. 128-byte swizzle); completes `box bytes` transaction bytes on the mbarrier bar_smem.
// Elements outside the tensor are filled with zeros and still count as transferred bytes.
__device__ __forceinline__ void cp_async_bulk_tensor_3d_global_to_shared(u32 dst_smem, const void* tensor_map, u32 bar_smem,
                                                                       int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst_smem), "l"(tensor_map), "r"(bar_smem), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void cp_async_bulk_tensor_4d_global_to_shared(u32 dst_smem, const void* tensor_map, u32 bar_smem,
                                                                       int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(dst_smem), "l"(tensor_map), "r"(bar_smem), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// PTX ISA 8.0+, "Data Movement: cp.async.bulk" (non-tensor), global -> shared: `bytes` contiguous bytes (a multiple
// of 16; both addresses 16-byte aligned), completing that many transaction bytes on the mbarrier bar_smem.
__device__ __forceinline__ void cp_async_bulk_global_to_shared(u32 dst_smem, const void* src, u32 bytes, u32 bar_smem) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst_smem), "l"(src), "r"(bytes), "r"(bar_smem) : "memory");
}
// PTX ISA 8.0+, "Data Movement: cp.reduce.async.bulk" (non-tensor), shared -> global, .add.f32: dst[i] += src[i] for
// `bytes` / 4 floats (each element's add is atomic), tracked by this thread's bulk async-groups. The shared source
// must have been written through the generic proxy before a fence.proxy.async (fence_proxy_async_shared).
__device__ __forceinline__ void cp_reduce_async_bulk_add_f32(float* dst, u32 src_smem, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src_smem), "r"(bytes) : "memory");
}
// PTX ISA 8.0+, "cp.async.bulk.commit_group": the bulk operations this thread issued since the last commit form a group.
__device__ __forceinline__ void cp_async_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// PTX ISA 8.0+, "cp.async.bulk.wait_group": waits until at most N of this thread's bulk groups are pending; .read:
// only until their sources have been read (the shared buffer may be rewritten), not until their writes are done.
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// PTX ISA 9.7.9.15 "prefetch": the 128-byte line holding a global address into L1 (a hint, no fault on any address).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// PTX ISA 8.0+, "prefetch, prefetchu" with .tensormap: brings a tensor map (generic address) into the TMA unit's cache.
__device__ __forceinline__ void prefetch_tensormap(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// PTX ISA, "Special Registers: %dynamic_smem_size": the dynamic shared memory this launch was given, in bytes
// (a kernel checks that the host's size, computed in Python, covers its own layout).
__device__ __forceinline__ u32 dynamic_smem_size() {
  u32 bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

// PTX ISA 8.0+, "Miscellaneous Instructions: setmaxnreg": every thread of the warpgroup (executed by all its warps, .sync.aligned) now
// holds at most REGS registers (.dec: returns the rest to the CTA's pool) or at least REGS (.inc: waits for them
// in the pool). REGS: 24..256, a multiple of 8. ptxas honours it only where each warpgroup's role is one branch
// of a uniform if/else (else warning C7508).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(REGS >= 24 && REGS <= 256 && REGS % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(REGS >= 24 && REGS <= 256 && REGS % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// PTX ISA, "Parallel Synchronization and Communication Instructions: bar, barrier": named barrier `id` (0 is __syncthreads') for `threads` threads (a multiple of
// 32). bar.sync: arrive and wait until `threads` have arrived; bar.arrive: arrive without waiting (the producer
// side of a producer/consumer hand-off: the waiting side counts the arriving warps in `threads`).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- thread-block clusters (sm_90): distributed shared memory, stores into another CTA, the cluster barrier ----
// A kernel declared with __cluster_dims__ runs its CTAs in clusters; CTA `rank` of a cluster reaches the shared
// memory of the others through shared::cluster addresses (mapa). Every CTA of a cluster must stay resident while
// another may still write to its shared memory: such kernels end with cluster_sync().

// The cluster shape of the pair kernels (two CTAs along x). NVRTC refuses __cluster_dims__ when it compiles kernels.cu
// for an architecture before sm_90, where those kernels are never instantiated: there the attribute is left out.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CUFLASH_CLUSTER_PAIR
#else
#define CUFLASH_CLUSTER_PAIR __cluster_dims__(2, 1, 1)
#endif

// PTX ISA, "Special Registers: %cluster_ctarank": this CTA's rank in its cluster, read anew at every use (volatile:
// a rank kept in a register across a consumer's loop cost the register that made ptxas serialize its wgmma)
__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// PTX ISA 8.0+, "Data Movement: mapa": the shared::cluster address of the variable that sits at shared::cta address
// `smem` in CTA `rank` of this cluster (the same layout in every CTA of the kernel).
__device__ __forceinline__ u32 map_shared_rank(u32 smem, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem), "r"(rank));
  return r;
}
// PTX ISA 8.1+, "Data Movement: st.async": a 16-byte store to another CTA's shared memory (address from
// map_shared_rank) that completes 16 transaction bytes on that CTA's mbarrier `bar_cluster` (also mapped): the
// receiving CTA's waiters see the data once the barrier's phase completes (its arrivals announce the bytes with
// mbarrier_arrive_expect_tx; bytes that land first leave the phase open until they are announced). No fence.
__device__ __forceinline__ void st_async_f32x4(u32 addr, float a, float b, float c, float d, u32 bar_cluster) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar_cluster) : "memory");
}
// PTX ISA 8.0+, "barrier.cluster": every thread of every CTA of the cluster arrives (release) and waits (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

}  // namespace cuflash
