// Paged KV storage and block manager (see kv_pool.h). Everything here runs on
// the scheduler thread; no operation depends on timing, and none allocates
// once the pool is built (apart from growing a BlockTable's vector).
#include "serve/kv_pool.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/rng.h"

namespace loom {

namespace {

constexpr uint64_t kChainSeed = 0x6c6f6f6d2d6b7621ull;  // root "parent" of a sequence's first block

size_t pow2_at_least(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

size_t KvPool::bytes_per_block(const ModelConfig& config, int64_t block_size, DType dtype) {
  return 2 * static_cast<size_t>(config.n_layers * block_size * config.kv_dim()) * elem_size(dtype);
}

int64_t KvPool::blocks_for_bytes(const ModelConfig& config, size_t bytes, int64_t block_size, DType dtype) {
  return static_cast<int64_t>(bytes / bytes_per_block(config, block_size, dtype));
}

KvPool::KvPool(Backend& backend, const ModelConfig& config, int64_t n_blocks, int64_t block_size, DType dtype)
    : n_layers_(config.n_layers),
      n_kv_heads_(config.n_kv_heads),
      head_dim_(config.head_dim),
      n_blocks_(n_blocks),
      block_size_(block_size),
      dtype_(dtype) {
  if (dtype != DType::f32 && dtype != DType::f16)
    fail(ErrorKind::invalid_input, "KV cache type {} is not supported (f32 or f16)", dtype_name(dtype));
  if (block_size < 1)
    fail(ErrorKind::invalid_input, "KV cache: block size {} must be at least 1", block_size);
  if (n_blocks < 1)
    fail(ErrorKind::invalid_input,
         "KV cache: {} blocks of {} positions; the memory budget must hold at least one", n_blocks,
         block_size);
  if (n_blocks > (int64_t{1} << 30))
    fail(ErrorKind::invalid_input, "KV cache: {} blocks is more than the 2^30 supported", n_blocks);
  LOOM_ASSERT(n_layers_ > 0 && n_kv_heads_ > 0 && head_dim_ > 0);
  layer_elems_ = n_blocks * block_size * kv_dim();
  storage_ = backend.alloc(bytes());

  const auto nb = static_cast<size_t>(n_blocks);
  ref_.assign(nb, 0);
  free_.reserve(nb);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));  // block 0 first
  key_.assign(nb, CacheKey{});
  key_tokens_.assign(nb * static_cast<size_t>(block_size), 0);
  lru_prev_.assign(nb, kNone);
  lru_next_.assign(nb, kNone);
  map_.assign(pow2_at_least(2 * nb), kNone);
}

int64_t KvPool::slot_of(const BlockTable& table, int64_t pos) const {
  const auto i = static_cast<size_t>(pos / block_size_);
  LOOM_ASSERT(pos >= 0 && i < table.blocks.size());
  return table.blocks[i] * block_size_ + pos % block_size_;
}

// --- allocation ---------------------------------------------------------

int64_t KvPool::blocks_needed(const BlockTable& table, int64_t n_tokens) const {
  const int64_t want = (n_tokens + block_size_ - 1) / block_size_;
  return std::max<int64_t>(0, want - table.n_blocks());
}

int32_t KvPool::take_block() {
  if (!free_.empty()) {
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  // Evict the least recently released cached block.
  const int32_t b = lru_head_;
  LOOM_ASSERT(b != kNone);
  lru_remove(b);
  uncache(b);
  return b;
}

bool KvPool::reserve(BlockTable& table, int64_t n_tokens) {
  const int64_t need = blocks_needed(table, n_tokens);
  if (need > free_blocks()) return false;
  for (int64_t i = 0; i < need; ++i) {
    const int32_t b = take_block();
    LOOM_ASSERT(ref_[static_cast<size_t>(b)] == 0);
    ref_[static_cast<size_t>(b)] = 1;
    ++n_in_use_;
    table.blocks.push_back(b);
  }
  return true;
}

void KvPool::release(BlockTable& table) {
  // Last block first: the LRU then evicts a sequence's tail before its head,
  // which other prompts are likelier to share.
  for (auto it = table.blocks.rbegin(); it != table.blocks.rend(); ++it) {
    const int32_t b = *it;
    int32_t& r = ref_[static_cast<size_t>(b)];
    LOOM_ASSERT(r > 0);
    if (--r > 0) continue;
    --n_in_use_;
    if (key_[static_cast<size_t>(b)].cached)
      lru_push_back(b);
    else
      free_.push_back(b);
  }
  table.blocks.clear();
  table.n_hashed = 0;
  table.chain_hash = 0;
}

// --- prefix cache -------------------------------------------------------

uint64_t KvPool::block_hash(uint64_t parent, int64_t adapter_id, const int32_t* tokens) const {
  uint64_t h = splitmix64(parent ^ 0x9e3779b97f4a7c15ull);
  h = splitmix64(h ^ static_cast<uint64_t>(adapter_id));
  for (int64_t i = 0; i < block_size_; ++i) h = splitmix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

int32_t KvPool::find_cached(uint64_t hash, uint64_t parent, int64_t adapter_id, const int32_t* tokens) const {
  const size_t mask = map_.size() - 1;
  for (size_t s = slot_of(hash);; s = (s + 1) & mask) {
    const int32_t b = map_[s];
    if (b == kNone) return kNone;
    const CacheKey& k = key_[static_cast<size_t>(b)];
    // The full key is compared, so a 64-bit hash collision cannot alias two prefixes.
    if (k.hash == hash && k.parent == parent && k.adapter_id == adapter_id &&
        std::memcmp(&key_tokens_[static_cast<size_t>(b * block_size_)], tokens,
                    static_cast<size_t>(block_size_) * sizeof(int32_t)) == 0)
      return b;
  }
}

int64_t KvPool::cached_prefix_length(int64_t adapter_id, std::span<const int32_t> tokens) const {
  const int64_t n_full = static_cast<int64_t>(tokens.size()) / block_size_;
  uint64_t parent = kChainSeed;
  int64_t i = 0;
  for (; i < n_full; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    const uint64_t h = block_hash(parent, adapter_id, t);
    if (find_cached(h, parent, adapter_id, t) == kNone) break;
    parent = h;
  }
  return i * block_size_;
}

int64_t KvPool::match_prefix(BlockTable& table, std::span<const int32_t> tokens) {
  LOOM_ASSERT(table.blocks.empty());
  const int64_t n_full = static_cast<int64_t>(tokens.size()) / block_size_;
  uint64_t parent = kChainSeed;
  int64_t i = 0;
  for (; i < n_full; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    const uint64_t h = block_hash(parent, table.adapter_id, t);
    const int32_t b = find_cached(h, parent, table.adapter_id, t);
    if (b == kNone) break;
    int32_t& r = ref_[static_cast<size_t>(b)];
    if (r++ == 0) {
      lru_remove(b);
      ++n_in_use_;
    }
    table.blocks.push_back(b);
    parent = h;
  }
  table.n_hashed = i;
  table.chain_hash = parent;
  return i * block_size_;
}

void KvPool::commit_full_blocks(BlockTable& table, std::span<const int32_t> tokens, int64_t n_computed) {
  LOOM_ASSERT(n_computed <= static_cast<int64_t>(tokens.size()));
  const int64_t n_full = n_computed / block_size_;
  LOOM_ASSERT(n_full <= table.n_blocks());
  if (table.n_hashed == 0) table.chain_hash = kChainSeed;
  for (int64_t i = table.n_hashed; i < n_full; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    const uint64_t parent = table.chain_hash;
    const uint64_t h = block_hash(parent, table.adapter_id, t);
    const int32_t b = table.blocks[static_cast<size_t>(i)];
    CacheKey& k = key_[static_cast<size_t>(b)];
    LOOM_ASSERT(!k.cached && ref_[static_cast<size_t>(b)] > 0);
    if (find_cached(h, parent, table.adapter_id, t) == kNone) {
      k = CacheKey{true, h, parent, table.adapter_id};
      std::memcpy(&key_tokens_[static_cast<size_t>(b * block_size_)], t,
                  static_cast<size_t>(block_size_) * sizeof(int32_t));
      map_insert(h, b);
      ++n_cached_;
    }
    table.chain_hash = h;
    table.n_hashed = i + 1;
  }
}

void KvPool::clear_cache() {
  while (lru_head_ != kNone) {
    const int32_t b = lru_head_;
    lru_remove(b);
    uncache(b);
    free_.push_back(b);
  }
  for (int32_t b = 0; b < static_cast<int32_t>(n_blocks_); ++b)
    if (key_[static_cast<size_t>(b)].cached) uncache(b);
  LOOM_ASSERT(n_cached_ == 0 && n_evictable_ == 0);
}

void KvPool::uncache(int32_t block) {
  CacheKey& k = key_[static_cast<size_t>(block)];
  LOOM_ASSERT(k.cached);
  map_erase(k.hash, block);
  k.cached = false;
  --n_cached_;
}

// --- LRU list of evictable blocks ---------------------------------------

void KvPool::lru_push_back(int32_t block) {
  const auto b = static_cast<size_t>(block);
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = kNone;
  if (lru_tail_ != kNone)
    lru_next_[static_cast<size_t>(lru_tail_)] = block;
  else
    lru_head_ = block;
  lru_tail_ = block;
  ++n_evictable_;
}

void KvPool::lru_remove(int32_t block) {
  const auto b = static_cast<size_t>(block);
  const int32_t p = lru_prev_[b], n = lru_next_[b];
  if (p != kNone)
    lru_next_[static_cast<size_t>(p)] = n;
  else
    lru_head_ = n;
  if (n != kNone)
    lru_prev_[static_cast<size_t>(n)] = p;
  else
    lru_tail_ = p;
  lru_prev_[b] = lru_next_[b] = kNone;
  --n_evictable_;
  LOOM_ASSERT(n_evictable_ >= 0);
}

// --- hash table ---------------------------------------------------------

void KvPool::map_insert(uint64_t hash, int32_t block) {
  const size_t mask = map_.size() - 1;
  size_t s = slot_of(hash);
  while (map_[s] != kNone) s = (s + 1) & mask;
  map_[s] = block;
}

void KvPool::map_erase(uint64_t hash, int32_t block) {
  const size_t mask = map_.size() - 1;
  size_t s = slot_of(hash);
  while (map_[s] != block) {
    LOOM_ASSERT(map_[s] != kNone);
    s = (s + 1) & mask;
  }
  // Backward-shift deletion: move later entries of the probe run into the hole
  // when their home slot does not lie cyclically in (hole, their slot].
  size_t hole = s;
  for (size_t j = (hole + 1) & mask; map_[j] != kNone; j = (j + 1) & mask) {
    const size_t home = slot_of(key_[static_cast<size_t>(map_[j])].hash);
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    map_[hole] = map_[j];
    hole = j;
  }
  map_[hole] = kNone;
}

double KvPool::usage() const { return static_cast<double>(n_in_use_) / static_cast<double>(n_blocks_); }

}  // namespace loom
