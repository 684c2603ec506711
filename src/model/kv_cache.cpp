#include "model/kv_cache.h"

#include "core/error.h"

namespace loom {

namespace {

size_t element_bytes(DType dtype) {
  LOOM_ASSERT(dtype == DType::f32 || dtype == DType::f16);
  return dtype == DType::f16 ? 2 : 4;
}

}  // namespace

KvCache::KvCache(const ModelConfig& c, int64_t n_ctx, DType dtype, Backend& backend)
    : n_ctx_(n_ctx),
      kv_dim_(c.kv_dim()),
      dtype_(dtype),
      k_(backend.alloc(static_cast<size_t>(c.n_layers * n_ctx * c.kv_dim()) * element_bytes(dtype))),
      v_(backend.alloc(static_cast<size_t>(c.n_layers * n_ctx * c.kv_dim()) * element_bytes(dtype))) {}

void* KvCache::at(const DeviceBuffer& b, int64_t layer, int64_t p) const {
  const auto offset = static_cast<size_t>((layer * n_ctx_ + p) * kv_dim_) * element_bytes(dtype_);
  return static_cast<char*>(b.data()) + offset;
}

}  // namespace loom
