// Loading, registering and evicting the server's LoRA adapters (adapter_registry.h).
#include "serve/adapter_registry.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include "core/finite_scan.h"
#include "model/gguf_lora.h"
#include "model/tensor_parallel.h"
#include "serve/engine_api.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether `path` (resolved) lies inside `root` (resolved).
bool inside(const fs::path& path, const fs::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p)
    if (p == path.end() || *p != *r) return false;
  return true;
}

// The files read_adapter opens in an adapter folder.
constexpr const char* kAdapterFiles[] = {"adapter_config.json", "adapter_model.safetensors"};

EngineError load_failed(const std::string& name, const std::string& message) {
  return EngineError(EngineErrc::adapter_load_failed, fmt::format("adapter '{}': {}", name, message), "lora_path");
}

// NaN / Inf weights, or a scale that makes scale * B * A overflow float32, would turn every output of the
// requests using the adapter into NaN: refuse the adapter instead, naming the tensor.
void check_finite(const std::string& name, const std::string& path, const peft::AdapterTensors& t) {
  const double scale = t.config.scaling();
  if (!std::isfinite(scale) || !std::isfinite(static_cast<float>(scale)))
    throw load_failed(name, fmt::format("{}/adapter_config.json: lora_alpha {} with r {} gives the scale {}, which is "
                                        "not a finite float32",
                                        path, t.config.lora_alpha, t.config.r, scale));
  const std::string file = path + "/adapter_model.safetensors";
  for (const auto& [key, pair] : t.pairs) {
    const auto [layer, target] = key;
    const int64_t r = t.config.r;
    float max_a = 0, max_b = 0;
    const struct {
      bool is_b;
      const float* data;
      int64_t n;
      float* max_abs;
    } tensors[] = {{false, pair.a_data(), r * pair.in, &max_a}, {true, pair.b_data(), pair.out * r, &max_b}};
    for (const auto& x : tensors) {
      const FiniteScan scan = scan_finite(x.data, x.n);
      if (const int64_t i = scan.first_non_finite; i >= 0)
        throw load_failed(name, fmt::format("{}: tensor '{}' has the non-finite value {} at element {}", file,
                                            peft::tensor_name(layer, target, x.is_b), x.data[i], i));
      *x.max_abs = scan.max_abs;
    }
    // Every element of scale * B * A is at most this in magnitude.
    const double bound = std::fabs(scale) * static_cast<double>(r) * max_a * max_b;
    if (!(bound <= std::numeric_limits<float>::max()))
      throw load_failed(name, fmt::format("{}: layer {} {}: the scale {} times B·A reaches {:g}, beyond float32 "
                                          "(lora_alpha {} with r {})",
                                          file, layer, lora_target_peft_name(target), scale, bound,
                                          t.config.lora_alpha, r));
  }
}

}  // namespace

void AdapterRegistry::check_contained(const std::string& path) const {
  // Every file the loader opens must resolve (symlinks followed) to a place inside an allowed folder; the
  // message names the file inside the adapter folder, never where it points.
  auto contained = [&](const fs::path& p) {
    std::error_code ec;
    const fs::path canon = fs::canonical(p, ec);
    if (ec) return true;  // missing: the loader reports it
    return std::any_of(allowed_.begin(), allowed_.end(), [&](const std::string& root) { return inside(canon, root); });
  };
  if (!contained(path))
    throw EngineError(EngineErrc::invalid_request,
                      "lora_path '" + path + "' is not inside an allowed adapter folder (--adapter-dir)", "lora_path");
  for (const char* f : kAdapterFiles)
    if (!contained(fs::path(path) / f))
      throw EngineError(EngineErrc::invalid_request,
                        fmt::format("{}/{} resolves to a file outside the allowed adapter folders (--adapter-dir); "
                                    "a symlink out of the folder is not followed",
                                    path, f),
                        "lora_path");
}

AdapterRegistry::AdapterRegistry(const ModelConfig& config, std::vector<std::string> allowed_dirs,
                                 int64_t max_resident, int lora_bits, size_t max_bytes, int tp_ranks)
    : config_(config),
      shard_(tensor_parallel_config(config, tp_ranks)),
      tp_ranks_(tp_ranks),
      max_resident_(std::max<int64_t>(1, max_resident)),
      lora_bits_(lora_bits),
      max_bytes_(max_bytes) {
  if (lora_bits != 32 && lora_bits != 16 && lora_bits != 8 && lora_bits != 4)
    throw EngineError(EngineErrc::invalid_request, fmt::format("--lora-bits {}: 4, 8, 16 or 32", lora_bits),
                      "lora_bits");
  for (const std::string& d : allowed_dirs) {
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(d, ec);
    if (ec || !fs::is_directory(canon))
      throw EngineError(EngineErrc::invalid_request, "--adapter-dir " + d + ": not a directory");
    allowed_.push_back(canon.string());
  }
}

std::shared_ptr<const LoadedAdapter> AdapterRegistry::load(const std::string& name, const std::string& path,
                                                           bool runtime) {
  // Checked at every load, reloads after eviction included: the folder may have changed meanwhile.
  if (runtime) check_contained(path);
  auto a = std::make_shared<LoadedAdapter>();
  a->name = name;
  a->path = path;
  try {
    a->tensors =
        peft::read_any_adapter(path, config_, /*map_f32=*/true);  // a PEFT folder or a GGUF LoRA file
    peft::check_adapter_fits(a->tensors, config_, path);
  } catch (const Error& e) {
    throw load_failed(name, e.what());
  }
  check_finite(name, path, a->tensors);
  if (tp_ranks_ > 1) {
    keep_tensor_parallel_parts(*a);
    keep_adapter_in_bits(*a, lora_bits_);
    return a;
  }
  a->view = ServeAdapter::empty(config_, static_cast<float>(a->tensors.config.scaling()));
  const int64_t r = a->tensors.config.r;
  for (auto& [key, pair] : a->tensors.pairs) {
    const auto [layer, target] = key;
    ServeLoraPair& sp = a->view.pair(layer, target);
    const float* b = pair.b_data();
    // GGUF llama stores q/k rows RoPE-interleaved; PEFT's B is in HF row order.
    if (lora_needs_qk_permutation(config_) && (target == LoraTarget::q || target == LoraTarget::k)) {
      a->owned.emplace_back(b, b + pair.out * r);
      const int64_t heads = target == LoraTarget::q ? config_.n_heads : config_.n_kv_heads;
      lora_permute_qk_rows(make_tensor(a->owned.back().data(), DType::f32, {pair.out, r}), heads, config_.head_dim,
                           /*hf_to_model=*/true);
      b = a->owned.back().data();
    }
    sp.a = make_tensor(const_cast<float*>(pair.a_data()), DType::f32, {r, pair.in});
    sp.b = make_tensor(const_cast<float*>(b), DType::f32, {pair.out, r});
  }
  try {
    a->view.validate(config_, path);
  } catch (const Error& e) {
    throw load_failed(name, e.what());
  }
  keep_adapter_in_bits(*a, lora_bits_);
  return a;
}

void AdapterRegistry::keep_tensor_parallel_parts(LoadedAdapter& a) const {
  for (int k = 1; k < tp_ranks_; ++k)
    a.follower_shards.push_back(make_adapter_shard(a.tensors, config_, k, tp_ranks_));
  AdapterShard own = make_adapter_shard(a.tensors, config_, 0, tp_ranks_);
  a.tensors = {};  // nothing points into the file: every part is a copy
  a.view = adapter_shard_view(own, shard_);
  a.owned.push_back(std::move(own.data));  // the buffer, and so the views into it, stay where they are
}

bool AdapterRegistry::add(const std::string& name, const std::string& path, bool runtime, bool replace) {
  if (name.empty()) throw EngineError(EngineErrc::invalid_request, "lora_name must not be empty", "lora_name");
  // A name is what requests give as "model" and what logs and metrics labels carry: printable, bounded.
  // Any other text ("org/adapter" too, as vLLM takes) is fine.
  constexpr size_t kMaxName = 256;
  if (name.size() > kMaxName)
    throw EngineError(EngineErrc::invalid_request,
                      fmt::format("lora_name is {} bytes long; at most {}", name.size(), kMaxName),
                      "lora_name");
  if (std::any_of(name.begin(), name.end(),
                  [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
    throw EngineError(EngineErrc::invalid_request, "lora_name holds a control character", "lora_name");
  std::string resolved = path;
  if (runtime) {
    if (allowed_.empty())
      throw EngineError(EngineErrc::invalid_request,
                        "loading adapters at run time is disabled: start the server with --adapter-dir DIR",
                        "lora_path");
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(path, ec);
    bool ok = !ec;
    if (ok) {
      ok = false;
      for (const std::string& root : allowed_) ok = ok || inside(canon, fs::path(root));
    }
    // The message does not echo which folders exist: only that the path is not allowed.
    if (!ok)
      throw EngineError(EngineErrc::invalid_request,
                        "lora_path '" + path + "' is not inside an allowed adapter folder (--adapter-dir)",
                        "lora_path");
    resolved = canon.string();
  }
  const auto find = [&] {
    return std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  };
  const auto exists = [&] {
    return EngineError(EngineErrc::adapter_exists,
                       "an adapter named '" + name + "' is already loaded (\"load_inplace\": true replaces it)",
                       "lora_name");
  };
  {
    std::lock_guard lock(mu_);
    if (!replace && find() != entries_.end()) throw exists();
  }
  // Outside the lock: disk and parsing. A failure throws here, before anything registered changes.
  auto loaded = load(name, resolved, runtime);
  if (max_bytes_ > 0 && loaded->bytes > max_bytes_)
    throw load_failed(name, fmt::format("it takes {} bytes, more than the adapters' memory limit of {} bytes "
                                        "(--max-lora-memory)",
                                        loaded->bytes, max_bytes_));
  std::lock_guard lock(mu_);
  const auto it = find();
  if (it != entries_.end() && !replace) throw exists();
  std::const_pointer_cast<LoadedAdapter>(loaded)->id = next_id_++;
  if (it != entries_.end()) {
    // The new version takes the old one's room (or free room); the old LoadedAdapter lives on in the
    // sequences that hold it and is freed with the last of them.
    it->loaded.reset();
    it->path = resolved;
    it->runtime = runtime;
    it->created = unix_now();
    it->last_used = ++clock_;
    it->bytes = loaded->bytes;
    if (make_room(it->bytes)) it->loaded = std::move(loaded);  // else registered only: loaded on first use
    return true;
  }
  Entry e{name, resolved, runtime, unix_now(), nullptr, ++clock_, loaded->bytes};
  if (make_room(e.bytes)) e.loaded = std::move(loaded);  // else registered only: loaded on first use
  entries_.push_back(std::move(e));
  return false;
}

void AdapterRegistry::remove(const std::string& name) {
  std::lock_guard lock(mu_);
  const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end())
    throw EngineError(EngineErrc::adapter_not_found, "no adapter named '" + name + "' is loaded", "lora_name");
  entries_.erase(it);  // sequences still running keep their shared_ptr
}

bool AdapterRegistry::contains(const std::string& name) const {
  std::lock_guard lock(mu_);
  return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
}

std::vector<AdapterInfo> AdapterRegistry::list() const {
  std::lock_guard lock(mu_);
  std::vector<AdapterInfo> out;
  for (const Entry& e : entries_)
    out.push_back({e.name, e.path, e.created, e.loaded != nullptr, e.loaded ? e.loaded->bytes : 0,
                   e.loaded ? e.loaded->f32_bytes : 0});
  return out;
}

int64_t AdapterRegistry::resident_count() const {
  std::lock_guard lock(mu_);
  int64_t n = 0;
  for (const Entry& e : entries_) n += e.loaded != nullptr;
  return n;
}

bool AdapterRegistry::evict_one() {
  Entry* victim = nullptr;
  for (Entry& e : entries_)
    if (e.loaded && e.loaded.use_count() == 1 && (!victim || e.last_used < victim->last_used)) victim = &e;
  if (!victim) return false;
  victim->loaded.reset();
  return true;
}

std::optional<std::shared_ptr<const LoadedAdapter>> AdapterRegistry::acquire(const std::string& name) {
  std::string path;
  bool runtime = false;
  {
    std::unique_lock lock(mu_);
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
    if (it == entries_.end()) return std::nullopt;
    it->last_used = ++clock_;
    if (it->loaded) return it->loaded;
    if (!make_room(it->bytes)) return std::shared_ptr<const LoadedAdapter>();
    path = it->path;
    runtime = it->runtime;
  }
  // Read outside the lock (disk, validation, packing); then the entry is looked
  // up again: unloaded meanwhile, loaded by another thread meanwhile, or the
  // room taken by another load.
  auto loaded = load(name, path, runtime);
  std::lock_guard lock(mu_);
  const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end() || it->path != path) return std::nullopt;
  if (it->loaded) return it->loaded;
  it->bytes = loaded->bytes;
  if (!make_room(it->bytes)) return std::shared_ptr<const LoadedAdapter>();
  std::const_pointer_cast<LoadedAdapter>(loaded)->id = next_id_++;
  it->loaded = loaded;
  return loaded;
}

size_t AdapterRegistry::resident_bytes() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const Entry& e : entries_) n += e.loaded ? e.loaded->bytes : 0;
  return n;
}

bool AdapterRegistry::make_room(size_t bytes) {
  for (;;) {
    int64_t count = 0;
    size_t used = 0;
    for (const Entry& e : entries_)
      if (e.loaded) {
        ++count;
        used += e.loaded->bytes;
      }
    if (count < max_resident_ && (max_bytes_ == 0 || used + bytes <= max_bytes_)) return true;
    if (!evict_one()) return false;
  }
}

}  // namespace loom
