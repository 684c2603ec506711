#include "model/kv_cache.h"

#include "core/error.h"

namespace loom {

KvCache::KvCache(const ModelConfig& c, int64_t n_ctx, DType dtype, Backend& backend)
    : n_ctx_(n_ctx),
      kv_dim_(c.kv_dim()),
      dtype_(dtype),
      k_(backend.alloc(dtype_row_bytes(dtype, c.n_layers * n_ctx * c.kv_dim()))),
      v_(backend.alloc(dtype_row_bytes(dtype, c.n_layers * n_ctx * c.kv_dim()))) {
  LOOM_ASSERT(dtype == DType::f32 || dtype == DType::f16);
}

void* KvCache::at(const DeviceBuffer& b, int64_t layer, int64_t p) const {
  return static_cast<char*>(b.data()) + dtype_row_bytes(dtype_, (layer * n_ctx_ + p) * kv_dim_);
}

}  // namespace loom
