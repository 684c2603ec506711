// Contiguous per-layer key/value store for one sequence (f32), in the memory
// of the backend's device. Row p holds the keys (or values) of position p for
// all kv heads. The paged cache of the server lives in serve/.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "model/config.h"

namespace loom {

class KvCache {
 public:
  KvCache(const ModelConfig& config, int64_t n_ctx, Backend& backend);

  int64_t n_ctx() const { return n_ctx_; }
  int64_t row_stride() const { return kv_dim_; }
  float* keys(int64_t layer) { return k_.floats() + layer * n_ctx_ * kv_dim_; }
  float* values(int64_t layer) { return v_.floats() + layer * n_ctx_ * kv_dim_; }
  size_t bytes() const { return k_.bytes() + v_.bytes(); }

 private:
  int64_t n_ctx_, kv_dim_;
  DeviceBuffer k_, v_;
};

}  // namespace loom
