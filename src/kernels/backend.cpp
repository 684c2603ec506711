#include "kernels/backend.h"

#include <cstdlib>
#include <utility>

#include "core/error.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/matmul.h"

namespace loom {

DeviceBuffer::DeviceBuffer(Device device, void* data, size_t bytes, FreeFn free_fn)
    : device_(device), data_(data), bytes_(bytes), free_(free_fn) {}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : device_(o.device_), data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)),
      free_(std::exchange(o.free_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (free_ != nullptr && data_ != nullptr) free_(data_, bytes_);
    device_ = o.device_;
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    free_ = std::exchange(o.free_, nullptr);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (free_ != nullptr && data_ != nullptr) free_(data_, bytes_);
}

bool weight_type_supported(DType type) { return matmul_supports(type); }

std::unique_ptr<Backend> make_backend(Device device, ThreadPool& pool) {
  switch (device.kind) {
    case DeviceKind::cpu:
      return make_cpu_backend(pool);
    case DeviceKind::cuda:
      fail(ErrorKind::unsupported,
           "device {}: this loom was built without CUDA (only the cpu backend is built; see docs/architecture.md, "
           "\"Backends\")",
           device_name(device));
    case DeviceKind::npu:
      fail(ErrorKind::unsupported,
           "device {}: this loom was built without an NPU backend (only the cpu backend is built; see "
           "docs/architecture.md, \"Backends\")",
           device_name(device));
  }
  fail(ErrorKind::internal, "unknown device kind");
}

}  // namespace loom
