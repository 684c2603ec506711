// Contiguous per-layer key/value store for one sequence, in the memory of the
// backend's device: row p holds the keys (or values) of position p for all kv
// heads, as f32 or IEEE half (f16, the default: llama.cpp's and loom's server
// cache type; it halves what a decode step reads at depth). The paged cache of
// the server lives in serve/.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/backend.h"
#include "model/config.h"

namespace loom {

class KvCache {
 public:
  // dtype: DType::f32 or DType::f16.
  KvCache(const ModelConfig& config, int64_t n_ctx, DType dtype, Backend& backend);

  int64_t n_ctx() const { return n_ctx_; }
  DType dtype() const { return dtype_; }
  // Layer `layer`'s rows, as attention reads them.
  KvRows rows(int64_t layer) const { return {at(k_, layer, 0), at(v_, layer, 0), dtype_}; }
  // Where position p's keys (values) of `layer` start: f32 or f16 elements.
  void* keys_at(int64_t layer, int64_t p) const { return at(k_, layer, p); }
  void* values_at(int64_t layer, int64_t p) const { return at(v_, layer, p); }
  size_t bytes() const { return k_.bytes() + v_.bytes(); }

 private:
  void* at(const DeviceBuffer& b, int64_t layer, int64_t p) const;

  int64_t n_ctx_, kv_dim_;
  DType dtype_;
  DeviceBuffer k_, v_;
};

}  // namespace loom
