// The host side of an eager CUTLASS plan in one C++ call: the output and the scratch buffer from
// torch's allocator, then the library's quantize-and-GEMM entry point (blockwise_gemm.cu's
// _quant_run_prepared) on them. From Python, each torch.empty and each ctypes call costs a few
// microseconds of host time, which an eager layer pays on every call; here they cost one call.
//
// Built by `fp8linear build-cutlass` against the installed torch (a Python extension module, no
// CUDA headers: the stream and the entry point come in as addresses), loaded by
// fp8linear/ops/cutlass_gemm.py. The entry point, its prepared parameters and the stream are the
// caller's to keep valid; x must be contiguous and 16-byte aligned (the plan checks both), on the
// GPU the prepared GEMM was made for. With `guard` (several GPUs visible) that GPU is made current
// for the call: the allocations and launches go to the current device.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// blockwise_gemm.cu's _quant_run_prepared: (prepared, x, x_stride, q, s, y, m, k, device, stream).
using QuantRunPrepared = int (*)(const void*, const void*, long long, void*, void*, void*, int, int, int, void*);

// y = empty(out_shape) in x's dtype and device, scratch = empty(scratch_bytes) bytes; x quantized into
// the scratch (the FP8 values at its start, the scales at scale_offset) and the GEMM run into y.
std::pair<at::Tensor, at::Tensor> allocate_and_run(const at::Tensor& x, const std::vector<int64_t>& out_shape,
                                                   int64_t entry, int64_t prepared, int64_t scratch_bytes,
                                                   int64_t scale_offset, int64_t m, int64_t k, int64_t device,
                                                   int64_t stream, bool guard, const std::string& what) {
  c10::OptionalDeviceGuard device_guard;
  if (guard) {
    device_guard.reset_device(x.device());
  }
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor scratch = at::empty({scratch_bytes}, x.options().dtype(at::kByte));
  auto* base = static_cast<char*>(scratch.data_ptr());
  const int rc = reinterpret_cast<QuantRunPrepared>(entry)(
      reinterpret_cast<const void*>(prepared), x.const_data_ptr(), static_cast<long long>(k), base,
      base + scale_offset, y.data_ptr(), static_cast<int>(m), static_cast<int>(k), static_cast<int>(device),
      reinterpret_cast<void*>(stream));
  if (rc != 0) {
    throw std::runtime_error(what + " failed with status " + std::to_string(rc));
  }
  return {std::move(y), std::move(scratch)};
}

at::Tensor quantize_and_run(const at::Tensor& x, const std::vector<int64_t>& out_shape, int64_t entry,
                            int64_t prepared, int64_t scratch_bytes, int64_t scale_offset, int64_t m, int64_t k,
                            int64_t device, int64_t stream, bool guard, const std::string& what) {
  return allocate_and_run(x, out_shape, entry, prepared, scratch_bytes, scale_offset, m, k, device, stream, guard,
                          what)
      .first;
}

}  // namespace

PYBIND11_MODULE(FP8L_MODULE, module) {
  module.doc() = "fp8linear: eager CUTLASS plans' allocations and library call in one host call";
  module.def("quantize_and_run", &quantize_and_run,
             "y = a new tensor of out_shape; x quantized into a new scratch buffer, then the prepared GEMM into y");
  module.def("quantize_and_run_kept", &allocate_and_run,
             "as quantize_and_run, returning (y, scratch): the scratch holds the quantized x and its scales");
}
