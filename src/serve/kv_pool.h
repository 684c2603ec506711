// Paged key/value storage of the server and its block manager: fixed-size
// blocks shared by all sequences, per-block reference counts, and a prefix
// cache of full blocks (keyed by token ids and adapter) with LRU eviction.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "model/config.h"

namespace loom {

// The blocks of one sequence: logical block i holds positions [i * block_size,
// (i + 1) * block_size). Owned by the scheduler, filled by KvPool.
struct BlockTable {
  // Identifies the adapter the sequence runs under (0: the base model). The
  // prefix cache never shares blocks between different ids, so an id must name
  // one set of adapter weights for the pool's lifetime. Set before first use.
  int64_t adapter_id = 0;
  std::vector<int32_t> blocks;
  // Leading blocks already registered in (or matched from) the prefix cache,
  // and the hash chain value of the last of them.
  int64_t n_hashed = 0;
  uint64_t chain_hash = 0;

  int64_t n_blocks() const { return static_cast<int64_t>(blocks.size()); }
};

class KvPool {
 public:
  // n_blocks blocks of block_size positions, each holding the keys and values
  // of those positions for every layer, stored as `dtype`: f32, or f16 (half
  // the memory traffic of decode attention, K/V rounded to nearest-even).
  // The storage is `backend`'s memory (the device its attention reads).
  KvPool(Backend& backend, const ModelConfig& config, int64_t n_blocks, int64_t block_size = 16,
         DType dtype = DType::f32);
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  // Bytes one block takes; blocks that fit in a byte budget (--kv-cache-memory).
  static size_t bytes_per_block(const ModelConfig& config, int64_t block_size = 16, DType dtype = DType::f32);
  static int64_t blocks_for_bytes(const ModelConfig& config, size_t bytes, int64_t block_size = 16,
                                  DType dtype = DType::f32);

  int64_t n_blocks() const { return n_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t n_layers() const { return n_layers_; }
  int64_t kv_dim() const { return n_kv_heads_ * head_dim_; }
  int64_t n_kv_heads() const { return n_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return 2 * static_cast<size_t>(layer_elems_ * n_layers_) * elem_size(dtype_); }

  // Layer `layer`'s keys (values) as [n_blocks][n_kv_heads][block_size][head_dim]
  // elements of dtype() (kernels/cpu/paged_attention.h): one kv head of a block is
  // contiguous, so attention streams through it.
  void* keys(int64_t layer) { return at(0, layer); }
  void* values(int64_t layer) { return at(1, layer); }
  const void* keys(int64_t layer) const { return const_cast<KvPool*>(this)->at(0, layer); }
  const void* values(int64_t layer) const { return const_cast<KvPool*>(this)->at(1, layer); }
  // The slot (block * block_size + index in block) of position `pos` of a sequence.
  int64_t slot_of(const BlockTable& table, int64_t pos) const;
  // Where kv head `head` of a slot starts in keys(layer) / values(layer), in elements.
  int64_t offset(int64_t slot, int64_t head) const {
    return ((slot / block_size_ * n_kv_heads_ + head) * block_size_ + slot % block_size_) * head_dim_;
  }

  // --- allocation -------------------------------------------------------
  // New blocks `table` needs to hold positions [0, n_tokens).
  int64_t blocks_needed(const BlockTable& table, int64_t n_tokens) const;
  // Appends blocks so that `table` holds positions [0, n_tokens). Returns
  // false, changing nothing, when fewer than blocks_needed() are available
  // (the scheduler then preempts). Evicts cached blocks (LRU) only as needed.
  bool reserve(BlockTable& table, int64_t n_tokens);
  // Drops the sequence's references and empties the table (keeps adapter_id).
  // Blocks registered in the prefix cache stay there until evicted.
  void release(BlockTable& table);

  // --- prefix cache -----------------------------------------------------
  // Gives an empty `table` the cached blocks of the longest cached prefix of
  // `tokens` made of full blocks under table.adapter_id (taking a reference on
  // each) and returns the number of positions they cover (a multiple of
  // block_size). Pass the prompt without its last token so that at least one
  // token is left to compute (its logits are needed).
  int64_t match_prefix(BlockTable& table, std::span<const int32_t> tokens);
  // How many positions match_prefix would return; changes nothing.
  int64_t cached_prefix_length(int64_t adapter_id, std::span<const int32_t> tokens) const;
  // Registers the full blocks of `table` whose positions are all computed
  // (those below n_computed); `tokens` are the sequence's ids (>= n_computed).
  // Blocks registered earlier are skipped; a block whose key another block
  // already holds stays private (its content is identical).
  void commit_full_blocks(BlockTable& table, std::span<const int32_t> tokens, int64_t n_computed);
  // Forgets every cached block that no sequence uses (e.g. after adapter ids
  // were reassigned).
  void clear_cache();

  // --- accounting -------------------------------------------------------
  // Blocks referenced by sequences / all blocks, in [0, 1].
  double usage() const;
  // Blocks reserve() can hand out now: never-used or invalidated ones plus
  // cached blocks no sequence uses (evictable).
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()) + n_evictable_; }
  // Blocks held by the prefix cache (in use or evictable).
  int64_t cached_blocks() const { return n_cached_; }
  int32_t ref_count(int32_t block) const { return ref_[static_cast<size_t>(block)]; }

 private:
  static constexpr int32_t kNone = -1;
  static size_t elem_size(DType t) { return t == DType::f16 ? 2 : 4; }

  void* at(int which, int64_t layer) {
    return static_cast<uint8_t*>(storage_.data()) +
           static_cast<size_t>((which * n_layers_ + layer) * layer_elems_) * elem_size(dtype_);
  }

  uint64_t block_hash(uint64_t parent, int64_t adapter_id, const int32_t* tokens) const;
  int32_t find_cached(uint64_t hash, uint64_t parent, int64_t adapter_id, const int32_t* tokens) const;
  int32_t take_block();
  void uncache(int32_t block);
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);
  // Open-addressing table hash -> block (linear probing, backward-shift delete).
  size_t slot_of(uint64_t hash) const { return static_cast<size_t>(hash) & (map_.size() - 1); }
  void map_insert(uint64_t hash, int32_t block);
  void map_erase(uint64_t hash, int32_t block);

  int64_t n_layers_, n_kv_heads_, head_dim_, n_blocks_, block_size_;
  DType dtype_;
  int64_t layer_elems_;   // n_blocks * block_size * n_kv_heads * head_dim
  DeviceBuffer storage_;  // all layers' keys, then all layers' values

  std::vector<int32_t> ref_;
  std::vector<int32_t> free_;  // stack of uncached, unreferenced blocks
  int64_t n_in_use_ = 0;

  // Prefix cache: per block its key (when cached), the LRU list of cached
  // blocks with no references (head evicted first), and the hash table.
  struct CacheKey {
    bool cached = false;
    uint64_t hash = 0, parent = 0;
    int64_t adapter_id = 0;
  };
  std::vector<CacheKey> key_;
  std::vector<int32_t> key_tokens_;  // [n_blocks, block_size]
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = kNone, lru_tail_ = kNone;
  int64_t n_evictable_ = 0, n_cached_ = 0;
  std::vector<int32_t> map_;  // block id or kNone; size a power of two >= 2 * n_blocks
};

}  // namespace loom
