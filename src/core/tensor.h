// A non-owning view of a contiguous row-major tensor on a Device. Arenas and
// mapped files own memory; a Tensor only points into them. Shapes are outermost first (as
// in PyTorch): a weight of a Linear(in=K, out=N) has shape {N, K}, each row a
// run of K elements (or K/block_size quantized blocks).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace loom {

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = kCpu;  // where data lives (only the CPU backend exists yet)
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  int64_t dim(int i) const { return shape[static_cast<size_t>(i < 0 ? ndim + i : i)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
  }
  int64_t cols() const { return ndim == 0 ? 1 : shape[static_cast<size_t>(ndim - 1)]; }
  // The product of the leading dims, not numel() / cols(): a zero-length last dim (legal in
  // safetensors) still has rows.
  int64_t rows() const {
    int64_t n = 1;
    for (int i = 0; i + 1 < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
  }
  size_t row_bytes() const { return dtype_row_bytes(dtype, cols()); }
  size_t nbytes() const { return row_bytes() * static_cast<size_t>(rows()); }

  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  const uint8_t* row_ptr(int64_t r) const {
    return static_cast<const uint8_t*>(data) + static_cast<size_t>(r) * row_bytes();
  }
  std::string shape_string() const;
};

Tensor make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape);

}  // namespace loom
