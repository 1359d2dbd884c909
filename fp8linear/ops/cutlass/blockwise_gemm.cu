// Blockwise-scaled FP8 GEMM on CUTLASS's Hopper warp-specialized kernels (sm_90a).
//
//   y (M, N) bf16 = (A (M, K) fp8 * SFA) @ (B (N, K) fp8 * SFB)^T (+ bias (N) bf16)
//
// The tensor cores multiply each 128-wide K group; the product is promoted into an fp32
// accumulator with its scales (DeepSeek-V3's recipe, as our Triton kernels and cuBLAS do).
// SFA: (M, ceil(K/128)) fp32 row-major, one scale per token and K group (what our activation
// quantizer writes); SFB: (ceil(N/128), ceil(K/128)) fp32 row-major, one per 128x128 weight block
// (the checkpoint's weight_scale_inv), or with FP8L_ROW (1x128 weights) one per weight row and K
// group, N-major: (ceil(K/128), N) contiguous. Both are read per element, so M and K/128 need no padding;
// A and B go through TMA (rows 16-byte aligned: K a multiple of 16), y through a TMA store (N a
// multiple of 8).
//
// One configuration per object file, chosen on the compiler's command line
// (fp8linear/tools/cutlass_build.py): FP8L_NAME (the symbols' prefix), FP8L_TILE_M (64: the
// ping-pong kernel, two consumer warpgroups taking turns on 64x128 tiles; 128: the cooperative
// kernel, both warpgroups on one 128x128 tile), FP8L_STREAMK (1: the cooperative kernel under
// CUTLASS's stream-K scheduler, which splits the K loop of the last wave's tiles over idle SMs
// instead of leaving them idle; or, asked per call, split-K: every tile's K loop in a given number
// of parts, their partial sums reduced in a fixed order), FP8L_BIAS (0 or 1: a fused bias),
// FP8L_ROW (0: 128x128 weight scales; 1: 1x128 weight scales) and FP8L_TILE_N (the tile's width:
// 128, or 64 for either kernel on 128x128 weights, whose scales it then reads per 64 rows:
// CUTLASS needs the tile width to be a multiple of the weight scales' N granularity).
// FP8L_PDL: every producer warp of the kernel waits in griddepcontrol.wait before its first global
// access (the consumer warps read only what those warps loaded), what a launch with programmatic
// dependent launch needs (_quant_run_prepared_pdl; a no-op in a plain launch). The ping-pong kernel
// does in CUTLASS's own header. The cooperative kernel's scale-loading warp (MainloopAux) does not
// in CUTLASS 4.2: it does with FP8L_COOPERATIVE_PDL=1, which the build passes with the include
// folder of its copy of that header where the warp waits (fp8linear/tools/cutlass_build.py,
// cooperative_overlay). CUTLASS's stream-K scheduler does not compile with the wait, and runs no
// prepared call.
#ifndef FP8L_COOPERATIVE_PDL
#define FP8L_COOPERATIVE_PDL 0
#endif
#if !FP8L_STREAMK && (FP8L_TILE_M == 64 || FP8L_COOPERATIVE_PDL)
#define FP8L_PDL 1
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#else
#define FP8L_PDL 0
#endif
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

// CUTLASS encodes three TMA descriptors per GEMM (A, B, y) through cuTensorMapEncodeTiled, and
// without CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL asks the runtime for that driver entry point at
// every descriptor. The library does not link libcuda, so the direct call goes to this function
// instead, which asks once per object (each variant's); _probe reports a failed lookup, so the
// kernels are not used where it fails (CUTLASS would go on with an unset descriptor under NDEBUG).
using fp8l_encode_fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                    const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static fp8l_encode_fn fp8l_encode_entry() {
  static const fp8l_encode_fn encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if (__CUDACC_VER_MAJOR__ > 12)  // as CUTLASS asks: by version from CUDA 13 on
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // leave no error behind for the caller's next check
      fn = nullptr;
    }
    return reinterpret_cast<fp8l_encode_fn>(fn);
  }();
  return encode;
}

static CUresult fp8l_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                            void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                            const cuuint32_t* box, const cuuint32_t* element_strides,
                                            CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                            CUtensorMapL2promotion promotion, CUtensorMapFloatOOBfill fill) {
  const fp8l_encode_fn encode = fp8l_encode_entry();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, promotion, fill);
}
// cuTensorMapReplaceAddress, for the prepared GEMMs below (asked once, as the encoder is).
using fp8l_replace_fn = CUresult (*)(CUtensorMap*, void*);

static fp8l_replace_fn fp8l_replace_entry() {
  static const fp8l_replace_fn replace = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if (__CUDACC_VER_MAJOR__ > 12)
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &fn, 12000, cudaEnableDefault,
                                                       &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapReplaceAddress", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<fp8l_replace_fn>(fn);
  }();
  return replace;
}
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#define cuTensorMapEncodeTiled fp8l_cuTensorMapEncodeTiled

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/arch/grid_dependency_control.h"

// The waits compile to nothing where CUTLASS does not enable them; a PDL launch would then race.
#if FP8L_PDL && defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "FP8L_PDL: CUTLASS did not enable griddepcontrol for this architecture (CUTLASS_GDC_ENABLED)"
#endif
#if FP8L_PDL && FP8L_TILE_M != 64 && !defined(FP8L_COOPERATIVE_AUX_WAITS)
#error "FP8L_COOPERATIVE_PDL=1 needs the build's copy of the cooperative kernel header first on the include path"
#endif

// One namespace per variant (its symbol prefix): the objects are linked into one library, and the
// kernel's name (cutlass::device_kernel<GemmKernel>) must differ between them. (`using namespace
// cute` stays inside it: at file scope it makes nvcc's host stub for the kernel ambiguous.)
namespace FP8L_NAME {

using namespace cute;

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // (N, K), K contiguous
using LayoutD = cutlass::layout::RowMajor;     // (M, N), N contiguous
constexpr int kAlignmentA = 16;  // elements of 16 bytes: TMA
constexpr int kAlignmentB = 16;
constexpr int kAlignmentD = 8;

#ifndef FP8L_TILE_N
#define FP8L_TILE_N 128
#endif
using TileShape = Shape<Int<FP8L_TILE_M>, Int<FP8L_TILE_N>, _128>;
using ClusterShape = Shape<_1, _1, _1>;
#if FP8L_TILE_M == 64
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

#if FP8L_ROW
// 1x128 activation scales K-major (row-major) as stored; 1x128 weight scales N-major (stride (1, N):
// the (K/128, N) layout Fp8BlockLinear keeps for its kernels and cuBLAS), one per weight row and K group.
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
#else
// 1x128 activation scales, 128x128 weight scales, both K-major (row-major) as stored; with a tile
// narrower than 128 columns, the weight scales of FP8L_TILE_N-row blocks ((ceil(N/FP8L_TILE_N),
// ceil(K/128)), each 128x128 block's scale repeated for its row blocks: CUTLASS needs the tile width
// to be a multiple of the weight scales' N granularity).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, (FP8L_TILE_N < 128 ? FP8L_TILE_N : 128), 128,
                                                              cute::GMMA::Major::K, cute::GMMA::Major::K>;
#endif
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

#if FP8L_BIAS
using FusionOperation = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementD, void, float>;
#else
using FusionOperation = cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>;
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD, kAlignmentD, ElementD, LayoutD, kAlignmentD, EpilogueSchedule, FusionOperation>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlignmentA,
    ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignmentB,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

#if FP8L_STREAMK
using TileScheduler = cutlass::gemm::StreamKScheduler;
#else
using TileScheduler = void;  // the persistent data-parallel scheduler
#endif
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, TileScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

typename Gemm::Arguments make_arguments(const void* a, const void* sfa, const void* b, const void* sfb, void* y,
                                        const void* bias, int m, int n, int k, int device, int sm_count,
                                        int splits) {
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementA*>(a), stride_a, static_cast<const ElementB*>(b), stride_b,
       static_cast<const float*>(sfa), ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1)),
       static_cast<const float*>(sfb), ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1))},
      {{}, nullptr, stride_d, static_cast<ElementD*>(y), stride_d}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  // the caller's cached SM count: CUTLASS would otherwise ask the current device on every call
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
#if FP8L_BIAS
  args.epilogue.thread.bias_ptr = static_cast<const ElementD*>(bias);
#else
  (void)bias;
#endif
#if FP8L_STREAMK
  if (splits > 1) {  // split-K: every tile's K loop in `splits` parts, reduced in order (deterministic)
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = decltype(args.scheduler.decomposition_mode)::SplitK;
  }
#else
  (void)splits;
#endif
  return args;
}

// ---- Per-token 1x128 activation quantization, launched with the GEMM by _quant_run_prepared ----
// The same bytes and scales as fp8linear/ops/quant.py's _act_quant_kernel on NVIDIA GPUs (its
// hardware-rounding form, e4m3fn): per 128-wide group, amax = max |x| (NaN where the group holds
// one) floored at kAmaxFloor, scale = amax / 448 correctly rounded, q = x / scale correctly rounded
// (divide below) clamped to +-448 (NaN kept), values of at most half the smallest subnormal set to
// +0, then cvt.rn.satfinite. Eight values (one 16-byte load) per lane and group, a group per half warp.
constexpr float kQmax = 448.0f;             // fp8linear.formats.activation_max(e4m3fn)
constexpr float kAmaxFloor = 1e-12f;        // fp8linear.reference.AMAX_FLOOR
constexpr float kHalfTiny = 0.0009765625f;  // 2**-10: half of e4m3fn's smallest subnormal 2**-9
constexpr int kQuantThreads = 256;          // 16 half warps per block
constexpr int kGroupsPerHalfWarp = 4;       // loads in flight per lane before the first reduction

// x / scale correctly rounded, from inv = RN(1 / scale): q = RN(x * inv) is within an ulp of the
// quotient, the remainder x - q * scale is exact in one fma, and RN(q + remainder * inv) is the
// correctly rounded quotient (Markstein's theorem, for quotients in fp32's normal range; smaller
// ones, below 2**-126, become FP8 zeros either way). That is act_quant's value: it rounds the fp64
// product fp64(x) * fp64(1 / scale) to fp32, which it shows to be the correctly rounded quotient. An
// infinite scale (a group holding an Inf) gives x * 0, as act_quant's product does (NaN for the Inf).
__device__ __forceinline__ float divide(float x, float scale, float inv) {
  const float q = __fmul_rn(x, inv);
  if (isinf(scale)) return q;
  return __fmaf_rn(__fmaf_rn(-q, scale, x), inv, q);
}

__device__ __forceinline__ float clamp_keep_nan(float q) {
  return q != q ? q : fminf(fmaxf(q, -kQmax), kQmax);
}

// x (m, k) bf16 with rows `x_stride` elements apart, k a multiple of 8 and rows 16-byte aligned;
// q (m, k) e4m3fn and s (m, groups) fp32, row-major. Half a warp takes kGroupsPerHalfWarp
// consecutive groups, all their loads issued before any group is reduced.
__global__ void __launch_bounds__(kQuantThreads) act_quant_kernel(const __nv_bfloat16* __restrict__ x,
                                                                 uint8_t* __restrict__ q, float* __restrict__ s,
                                                                 int m, int k, int groups, long long x_stride) {
  // The GEMM launched after us with PDL (_quant_run_prepared_pdl) may be scheduled from now on: its
  // CTAs set up (barriers, TMA descriptor prefetch) and then wait in griddepcontrol.wait until this
  // grid has completed and its writes are visible. A no-op where nothing follows with PDL.
  asm volatile("griddepcontrol.launch_dependents;");
  // Launched with PDL itself (launch_act_quant's `pdl`), this grid may be placed while the kernel
  // before it still runs: x is read only once that kernel has completed and its writes are visible.
  // A no-op in a plain launch.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // m * groups < 2**31 (launch_act_quant checks): 32-bit indices, and 32-bit divisions below
  const int first =
      static_cast<int>((static_cast<long long>(blockIdx.x) * kQuantThreads + threadIdx.x) / 16) * kGroupsPerHalfWarp;
  const int items = m * groups;
  const int lane16 = threadIdx.x % 16;
  const unsigned half_mask = (threadIdx.x % 32) < 16 ? 0x0000ffffu : 0xffff0000u;
  uint4 raw[kGroupsPerHalfWarp];
#pragma unroll
  for (int j = 0; j < kGroupsPerHalfWarp; ++j) {
    const int item = first + j;
    const long long row = item / groups;
    const int col = (item % groups) * 128 + lane16 * 8;
    // k % 8 == 0: a lane's eight values are all in range or all out
    raw[j] = item < items && col < k ? *reinterpret_cast<const uint4*>(x + row * x_stride + col)
                                     : make_uint4(0u, 0u, 0u, 0u);  // bf16 zeros
  }
  // the groups side by side at every step (independent chains: their latencies overlap)
  float v[kGroupsPerHalfWarp][8], amax[kGroupsPerHalfWarp];
  bool nan[kGroupsPerHalfWarp];
#pragma unroll
  for (int j = 0; j < kGroupsPerHalfWarp; ++j) {
    const uint32_t words[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
      v[j][2 * i] = pair.x, v[j][2 * i + 1] = pair.y;
    }
    nan[j] = false;
    amax[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      nan[j] |= v[j][i] != v[j][i];
      amax[j] = fmaxf(amax[j], fabsf(v[j][i]));
    }
  }
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) {
#pragma unroll
    for (int j = 0; j < kGroupsPerHalfWarp; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], offset));
  }
#pragma unroll
  for (int j = 0; j < kGroupsPerHalfWarp; ++j) {
    // every lane takes part in the shuffles above; lanes past the last group or K store nothing
    if (__ballot_sync(0xffffffffu, nan[j]) & half_mask) amax[j] = __int_as_float(0x7fc00000);  // NaN
    const int item = first + j;
    if (item >= items) continue;
    const long long row = item / groups;
    const int group = item % groups;
    const int col = group * 128 + lane16 * 8;
    // every lane of the group computes its scale and the scale's correctly rounded reciprocal
    const float scale = __fdiv_rn(amax[j] != amax[j] ? amax[j] : fmaxf(amax[j], kAmaxFloor), kQmax);
    const float inv_scale = __frcp_rn(scale);
    if (lane16 == 0) s[row * groups + group] = scale;
    if (col >= k) continue;
    uint32_t packed[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      float qv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float t = clamp_keep_nan(divide(v[j][4 * w + i], scale, inv_scale));
        qv[i] = fabsf(t) <= kHalfTiny ? 0.0f : t;  // NaN compares false: kept
      }
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(qv[0], qv[1]), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(qv[2], qv[3]), __NV_SATFINITE, __NV_E4M3);
      packed[w] = lo | (hi << 16);
    }
    *reinterpret_cast<uint2*>(q + row * k + col) = make_uint2(packed[0], packed[1]);
  }
}

// 0, else 3000 + the cudaError_t of the launch. With `pdl` the kernel is launched with programmatic
// dependent launch after the stream's previous kernel (it waits for it before reading x).
inline int launch_act_quant(const void* x, long long x_stride, void* q, void* s, int m, int k, cudaStream_t stream,
                            bool pdl = false) {
  const int groups = (k + 127) / 128;
  const long long items = static_cast<long long>(m) * groups;
  if (items + kGroupsPerHalfWarp > (1ll << 31) - 1) return 3000 + static_cast<int>(cudaErrorInvalidValue);
  const long long threads = (items + kGroupsPerHalfWarp - 1) / kGroupsPerHalfWarp * 16;
  const unsigned blocks = static_cast<unsigned>((threads + kQuantThreads - 1) / kQuantThreads);
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* qb = static_cast<uint8_t*>(q);
  auto* sf = static_cast<float*>(s);
  cudaError_t err;
  if (pdl) {
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(kQuantThreads);
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    err = cudaLaunchKernelEx(&config, act_quant_kernel, xb, qb, sf, m, k, groups, x_stride);
  } else {
    act_quant_kernel<<<blocks, kQuantThreads, 0, stream>>>(xb, qb, sf, m, k, groups, x_stride);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) cudaGetLastError();  // reported here, not to the caller's next launch check
  return err == cudaSuccess ? 0 : 3000 + static_cast<int>(err);
}

}  // namespace FP8L_NAME

using FP8L_NAME::Gemm;
using FP8L_NAME::GemmKernel;
using FP8L_NAME::make_arguments;
using FP8L_NAME::launch_act_quant;

#define FP8L_JOIN2(a, b) a##b
#define FP8L_JOIN(a, b) FP8L_JOIN2(a, b)

// 0 where this configuration can run an (m, n, k) problem, else a cutlass::Status code.
extern "C" int FP8L_JOIN(FP8L_NAME, _can_implement)(int m, int n, int k) {
  return static_cast<int>(Gemm::can_implement(make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                             m, n, k, 0, 1, 1)));
}

// 1 where this kernel may be launched with PDL after the quantization (_quant_run_prepared_pdl), else 0.
extern "C" int FP8L_JOIN(FP8L_NAME, _pdl)() { return FP8L_PDL; }

// 0 where the current device can run this kernel (its code loads: driver, architecture), else
// the cudaError_t of the attempt. Enqueues nothing.
extern "C" int FP8L_JOIN(FP8L_NAME, _probe)() {
  cudaFuncAttributes attributes;
  cudaError_t err = cudaFuncGetAttributes(&attributes, cutlass::device_kernel<GemmKernel>);
  if (err != cudaSuccess) return static_cast<int>(err);
  return fp8l_encode_entry() != nullptr ? 0 : static_cast<int>(cudaErrorSymbolNotFound);
}

// Bytes of device workspace a call of (m, n, k) needs on `device` with `sm_count` SMs. `splits` > 1
// (the stream-K kernel only): a split-K decomposition into that many parts of each tile's K loop.
extern "C" size_t FP8L_JOIN(FP8L_NAME, _workspace_size)(int m, int n, int k, int device, int sm_count, int splits) {
  return Gemm::get_workspace_size(make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k,
                                                 device, sm_count, splits));
}

// The kernel's shared-memory limit, raised once per device (Gemm::initialize would do it at every
// call): 0, else 1000 + the cudaError_t.
static int raise_smem_limit(int device) {
  static std::atomic<unsigned long long> smem_raised{0};  // bit d: done on device d (< 64)
  const unsigned long long bit = device >= 0 && device < 64 ? 1ull << device : 0;
  if (bit == 0 || (smem_raised.load(std::memory_order_acquire) & bit) == 0) {
    constexpr int smem = GemmKernel::SharedStorageSize;
    if (smem >= (48 << 10)) {
      cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) {
        cudaGetLastError();  // reported here, not to the caller's next launch check
        return 1000 + static_cast<int>(err);
      }
    }
    smem_raised.fetch_or(bit, std::memory_order_release);
  }
  return 0;
}

// Enqueue the GEMM on `stream` (of `device`, the current device): 0, else a cutlass::Status code (a
// failed launch: kErrorInternal) or 1000 + the cudaError_t of raising the shared-memory limit.
extern "C" int FP8L_JOIN(FP8L_NAME, _run)(const void* a, const void* sfa, const void* b, const void* sfb, void* y,
                                          const void* bias, int m, int n, int k, int device, int sm_count,
                                          int splits, void* workspace, cudaStream_t stream) {
  // the launch is Gemm::run on the parameters, as Gemm::initialize + run would make
  if (int rc = raise_smem_limit(device)) return rc;
  auto args = make_arguments(a, sfa, b, sfb, y, bias, m, n, k, device, sm_count, splits);
  cutlass::Status status = GemmKernel::initialize_workspace(args, workspace, stream, nullptr);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  return static_cast<int>(Gemm::run(params, stream));  // checks the launch (cudaGetLastError) itself
}

// A GEMM prepared for one weight and M: the kernel's parameters made once (TMA descriptors encoded,
// scheduler set up), so that a call copies them, points the activations' and the output's TMA
// descriptors at its own tensors (cuTensorMapReplaceAddress) and the activation scales' pointer,
// and launches: no argument building, descriptor encoding or workspace setup per call. For the
// data-parallel kernels, which need no workspace; elsewhere (stream-K) nullptr, and _run serves.
using Params = typename GemmKernel::Params;

extern "C" void* FP8L_JOIN(FP8L_NAME, _prepare)(const void* b, const void* sfb, const void* bias, int m, int n, int k,
                                                int device, int sm_count) {
#if FP8L_STREAMK
  (void)b, (void)sfb, (void)bias, (void)m, (void)n, (void)k, (void)device, (void)sm_count;
  return nullptr;
#else
  if (fp8l_replace_entry() == nullptr || fp8l_encode_entry() == nullptr) return nullptr;
  // the weight's address stands in for the activations' and the output's: each call replaces them
  auto args = make_arguments(b, sfb, b, sfb, const_cast<void*>(b), bias, m, n, k, device, sm_count, 1);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess || Gemm::get_workspace_size(args) != 0) return nullptr;
  return new (std::nothrow) Params(GemmKernel::to_underlying_arguments(args, nullptr));
#endif
}

// Enqueue a prepared GEMM on `stream` (of `device`, the current device), with programmatic dependent
// launch where `pdl` (the kernel waits in griddepcontrol.wait, CUTLASS_ENABLE_GDC_FOR_SM90, before
// its first global access): 0, else a cutlass::Status code, 1000 + a cudaError_t (the
// shared-memory limit) or 2000 + a CUresult (an address replaced).
static int run_prepared(const void* prepared, const void* a, const void* sfa, void* y, int device,
                        cudaStream_t stream, bool pdl) {
  if (int rc = raise_smem_limit(device)) return rc;
  Params params = *static_cast<const Params*>(prepared);
  const fp8l_replace_fn replace = fp8l_replace_entry();
  auto* desc_a = const_cast<cute::TmaDescriptor*>(params.mainloop.tma_load_a.get_tma_descriptor());
  auto* desc_d = const_cast<cute::TmaDescriptor*>(params.epilogue.tma_store_d.get_tma_descriptor());
  if (CUresult r = replace(reinterpret_cast<CUtensorMap*>(desc_a), const_cast<void*>(a))) return 2000 + static_cast<int>(r);
  if (CUresult r = replace(reinterpret_cast<CUtensorMap*>(desc_d), y)) return 2000 + static_cast<int>(r);
  params.mainloop.ptr_SFA = static_cast<const float*>(sfa);
  return static_cast<int>(Gemm::run(params, stream, nullptr, pdl));
}

// Enqueue a prepared GEMM on `stream` (of `device`, the current device): run_prepared's codes.
extern "C" int FP8L_JOIN(FP8L_NAME, _run_prepared)(const void* prepared, const void* a, const void* sfa, void* y,
                                                   int device, cudaStream_t stream) {
  return run_prepared(prepared, a, sfa, y, device, stream, false);
}

extern "C" void FP8L_JOIN(FP8L_NAME, _release)(void* prepared) { delete static_cast<Params*>(prepared); }

// Quantize x (m, k) bf16, rows x_stride elements apart, into q and s, as _run_prepared's a and
// sfa, then enqueue the prepared GEMM: both on `stream`, from one host call. 0, else run_prepared's
// codes or 3000 + the cudaError_t of the quantization's launch.
extern "C" int FP8L_JOIN(FP8L_NAME, _quant_run_prepared)(const void* prepared, const void* x, long long x_stride,
                                                         void* q, void* s, void* y, int m, int k, int device,
                                                         cudaStream_t stream) {
  if (int rc = launch_act_quant(x, x_stride, q, s, m, k, stream)) return rc;
  return run_prepared(prepared, q, s, y, device, stream, false);
}

// As _quant_run_prepared, both kernels launched with programmatic dependent launch: the
// quantization's CTAs may be placed while the stream's previous kernel still runs, and wait for it
// before reading x; the GEMM's while the quantization still runs (which releases them at its start),
// and wait for it before reading q and s or writing y.
extern "C" int FP8L_JOIN(FP8L_NAME, _quant_run_prepared_pdl)(const void* prepared, const void* x, long long x_stride,
                                                             void* q, void* s, void* y, int m, int k, int device,
                                                             cudaStream_t stream) {
  if (!FP8L_PDL) return static_cast<int>(cutlass::Status::kErrorNotSupported);  // its loads would not wait
  if (int rc = launch_act_quant(x, x_stride, q, s, m, k, stream, true)) return rc;
  return run_prepared(prepared, q, s, y, device, stream, true);
}
