#include "model/kv_cache.h"

namespace loom {

KvCache::KvCache(const ModelConfig& c, int64_t n_ctx, Backend& backend)
    : n_ctx_(n_ctx),
      kv_dim_(c.kv_dim()),
      k_(backend.alloc(static_cast<size_t>(c.n_layers * n_ctx * c.kv_dim()) * sizeof(float))),
      v_(backend.alloc(static_cast<size_t>(c.n_layers * n_ctx * c.kv_dim()) * sizeof(float))) {}

}  // namespace loom
