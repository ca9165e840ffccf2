// ptx.cuh: the only file with inline assembly. Each wrapper is named after its PTX instruction and
// cites the section of the PTX ISA (version 8.x) that defines it. No host headers: NVRTC compiles this.
#pragma once

namespace cuflash {

typedef unsigned int u32;
typedef unsigned short u16;

// Element-type tags. Storage is 16-bit; the tags select the mma / cvt variants.
struct f16 {};
struct bf16 {};

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
};
template <>
struct Cvt<bf16> {
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(static_cast<u32>(x) << 16); }
};

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

// Two adjacent floats in one request (PTX ISA 9.7.13.7, .v2.f32 needs sm_90); two scalar reds before.
__device__ __forceinline__ void red_add_v2_f32(float* addr, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b));
#else
  red_add_f32(addr, a);
  red_add_f32(addr + 1, b);
#endif
}

}  // namespace cuflash
