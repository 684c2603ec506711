#include "core/tensor.h"

#include <fmt/format.h>

namespace loom {

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", shape[static_cast<size_t>(i)]);
  return s + "]";
}

Tensor make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  LOOM_ASSERT(shape.size() <= Tensor::kMaxDims);
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  size_t i = 0;
  for (int64_t d : shape) t.shape[i++] = d;
  return t;
}

}  // namespace loom
