// The server's LoRA adapters: names registered at start-up or at run time
// (POST /v1/load_lora_adapter), each loaded from a PEFT folder with its F32
// tensors memory-mapped (or kept in bf16 / 4 bits), at most `max_resident` and
// `max_bytes` in memory (least recently used evicted and reloaded on demand),
// so thousands can be registered while the ones in use stay resident.
// Thread-safe: HTTP threads register, unregister and acquire (loading off the
// scheduler thread), the scheduler thread acquires what it still needs; loads
// run outside the lock.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "serve/loaded_adapter.h"

namespace loom {

struct AdapterInfo {
  std::string name, path;
  int64_t created = 0;  // unix seconds of registration (or of its replacement)
  bool resident = false;
  size_t bytes = 0, f32_bytes = 0;  // the resident factors' memory as kept, and in f32 (0 when not resident)
};

class AdapterRegistry {
 public:
  // allowed_dirs: run-time loads must name a folder inside one of them
  // (checked after resolving symlinks and ".."); empty: run-time loading is off.
  // lora_bits 4: every adapter's A and B are kept in 4 bits (kernels/int_quant.h:
  // symmetric, one scale per group of 128 columns or the fitting multiple of
  // 32 below, per row for B's short rows), which the LoRA kernel reads in
  // place (kernels/int4_rows.h); 8: in int8 (kernels/lora_i8.h: a scale per
  // row of A and per 64 values of a column of B, a quarter of f32's bytes);
  // 16: kept in bf16 (half the bytes); all read in place; 32: kept in f32
  // (memory-mapped).
  // max_bytes: the resident adapters' memory (LoadedAdapter::bytes) at most;
  // 0: no limit but max_resident.
  // tp_ranks > 1 (rank 0 of `loom serve --tp N`): `config` is the whole
  // model's; each adapter is validated whole, then kept as rank 0's part
  // (adapter_shard.h) with the followers' parts in follower_shards, and
  // bytes / max_bytes count one rank's part.
  AdapterRegistry(const ModelConfig& config, std::vector<std::string> allowed_dirs, int64_t max_resident,
                  int lora_bits = 32, size_t max_bytes = 0, int tp_ranks = 1);

  // Loads and validates `path` and registers it as `name`. `runtime`: the
  // request came over HTTP, so the path and every file read from it (symlinks
  // resolved) must be inside an allowed folder. Adapters whose weights or scale
  // are not finite are refused. A name already registered is refused
  // (adapter_exists) unless `replace` (vLLM's load_inplace): then the new
  // version is loaded and validated in full first (a failure leaves the old
  // one registered), then swapped in with a new id and `created`; holders of
  // the old LoadedAdapter (running sequences) keep it, later acquires get the
  // new one. Returns true when it replaced an adapter.
  // Throws EngineError (adapter_exists, adapter_load_failed, invalid_request).
  bool add(const std::string& name, const std::string& path, bool runtime, bool replace = false);
  // Throws EngineError(adapter_not_found).
  void remove(const std::string& name);
  bool contains(const std::string& name) const;
  std::vector<AdapterInfo> list() const;
  int64_t resident_count() const;
  size_t resident_bytes() const;

  // The loaded adapter for `name`, loading it again if it was evicted (evicting
  // least recently used adapters no running sequence holds until it fits).
  // nullopt when the name is unknown (unloaded meanwhile); throws EngineError
  // when a reload fails. Returns null inside the optional when it does not fit
  // beside the adapters in use (max_resident, max_bytes; the caller waits).
  // The file is read outside the lock: other threads' acquires of resident
  // adapters do not wait for it.
  std::optional<std::shared_ptr<const LoadedAdapter>> acquire(const std::string& name);

 private:
  struct Entry {
    std::string name, path;
    bool runtime = false;  // loaded over HTTP: its files must stay inside an allowed folder
    int64_t created = 0;
    std::shared_ptr<const LoadedAdapter> loaded;
    uint64_t last_used = 0;
    size_t bytes = 0;  // its memory when resident (known from its registration)
  };
  // Reads, validates (shapes, finite weights and scale) and prepares an adapter; `runtime`: first checks
  // that the folder and every file read from it resolve to places inside an allowed folder.
  std::shared_ptr<const LoadedAdapter> load(const std::string& name, const std::string& path, bool runtime);
  // Throws EngineError(invalid_request) naming the folder or the file that resolves outside them.
  void check_contained(const std::string& path) const;
  // Drops the least recently used resident adapter that no one else holds; false if none.
  bool evict_one();
  // Evicts (LRU, never one in use) until one more adapter of `bytes` fits both
  // limits; false if it cannot. Under mu_.
  bool make_room(size_t bytes);

  // Keeps rank 0's part of a->tensors in a and cuts the followers' (tp_ranks_ > 1).
  void keep_tensor_parallel_parts(LoadedAdapter& a) const;

  const ModelConfig& config_;
  ModelConfig shard_;  // one tensor-parallel rank's shapes (config_ when tp_ranks_ is 1)
  int tp_ranks_ = 1;
  std::vector<std::string> allowed_;
  int64_t max_resident_;
  int lora_bits_ = 32;
  size_t max_bytes_ = 0;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
  int64_t next_id_ = 1;
  uint64_t clock_ = 0;
};

}  // namespace loom
