// The host side of an eager CUTLASS plan in one C++ call: the output and the scratch buffer from
// torch's allocator, then the library's quantize-and-GEMM entry point (blockwise_gemm.cu's
// _quant_run_prepared) on them. From Python, each torch.empty and each ctypes call costs a few
// microseconds of host time, which an eager layer pays on every call; here they cost one call.
//
// Built by `fp8linear build-cutlass` against the installed torch (a Python extension module, no
// CUDA headers: the stream and the entry point come in as addresses), loaded by
// fp8linear/ops/cutlass_gemm.py. The entry point and its prepared parameters are the caller's to
// keep valid for as long as a PreparedRun holding them lives, the stream for the call; x must be
// contiguous and 16-byte aligned (the plan checks both), on the GPU the prepared GEMM was made for.
// With `guard` (several GPUs visible) that GPU is made current for the call: the allocations and
// launches go to the current device.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
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

// One plan's call: its fixed arguments held here, so that a call converts only x and the stream.
// The dozen arguments of a plain function converted per call cost about 0.3 us more (x86 host,
// torch 2.13, CPU tensors, a no-op entry point: 1.47-1.58 against 1.19-1.25 us a call).
class PreparedRun {
 public:
  PreparedRun(std::vector<int64_t> out_shape, int64_t entry, int64_t prepared, int64_t scratch_bytes,
              int64_t scale_offset, int64_t m, int64_t k, int64_t device, bool guard, std::string what)
      : out_shape_(std::move(out_shape)), entry_(entry), prepared_(prepared), scratch_bytes_(scratch_bytes),
        scale_offset_(scale_offset), m_(m), k_(k), device_(device), guard_(guard), what_(std::move(what)) {}

  at::Tensor run(const at::Tensor& x, int64_t stream) const { return kept(x, stream).first; }

  std::pair<at::Tensor, at::Tensor> kept(const at::Tensor& x, int64_t stream) const {
    return allocate_and_run(x, out_shape_, entry_, prepared_, scratch_bytes_, scale_offset_, m_, k_, device_, stream,
                            guard_, what_);
  }

 private:
  std::vector<int64_t> out_shape_;
  int64_t entry_, prepared_, scratch_bytes_, scale_offset_, m_, k_, device_;
  bool guard_;
  std::string what_;
};

}  // namespace

PYBIND11_MODULE(FP8L_MODULE, module) {
  module.doc() = "fp8linear: eager CUTLASS plans' allocations and library call in one host call";
  pybind11::class_<PreparedRun>(module, "PreparedRun",
                                 "PreparedRun(out_shape, entry, prepared, scratch_bytes, scale_offset, m, k, device, "
                                 "guard, what): one plan's call")
      .def(pybind11::init<std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                          std::string>())
      .def("__call__", &PreparedRun::run,
           "(x, stream) -> y: a new tensor of out_shape; x quantized into a new scratch buffer, then the prepared "
           "GEMM into y")
      .def("kept", &PreparedRun::kept,
           "(x, stream) -> (y, scratch): as a call, the scratch (the quantized x and its scales) returned too");
}
