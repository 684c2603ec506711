// Loading, registering and evicting the server's LoRA adapters (adapter_registry.h).
#include "serve/adapter_registry.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

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

}  // namespace

AdapterRegistry::AdapterRegistry(const ModelConfig& config, std::vector<std::string> allowed_dirs,
                                 int64_t max_resident)
    : config_(config), max_resident_(std::max<int64_t>(1, max_resident)) {
  for (const std::string& d : allowed_dirs) {
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(d, ec);
    if (ec || !fs::is_directory(canon))
      throw EngineError(EngineErrc::invalid_request, "--adapter-dir " + d + ": not a directory");
    allowed_.push_back(canon.string());
  }
}

std::shared_ptr<const LoadedAdapter> AdapterRegistry::load(const std::string& name, const std::string& path) {
  auto a = std::make_shared<LoadedAdapter>();
  a->name = name;
  a->path = path;
  try {
    a->tensors = peft::read_adapter(path, /*map_f32=*/true);
    peft::check_adapter_fits(a->tensors, config_, path);
  } catch (const Error& e) {
    throw EngineError(EngineErrc::adapter_load_failed, fmt::format("adapter '{}': {}", name, e.what()), "lora_path");
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
    throw EngineError(EngineErrc::adapter_load_failed, fmt::format("adapter '{}': {}", name, e.what()), "lora_path");
  }
  return a;
}

void AdapterRegistry::add(const std::string& name, const std::string& path, bool runtime) {
  if (name.empty()) throw EngineError(EngineErrc::invalid_request, "lora_name must not be empty", "lora_name");
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
  {
    std::lock_guard lock(mu_);
    for (const Entry& e : entries_)
      if (e.name == name)
        throw EngineError(EngineErrc::adapter_exists, "an adapter named '" + name + "' is already loaded",
                          "lora_name");
  }
  auto loaded = load(name, resolved);  // outside the lock: disk and parsing
  std::lock_guard lock(mu_);
  for (const Entry& e : entries_)
    if (e.name == name)
      throw EngineError(EngineErrc::adapter_exists, "an adapter named '" + name + "' is already loaded", "lora_name");
  std::const_pointer_cast<LoadedAdapter>(loaded)->id = next_id_++;
  int64_t resident = 0;
  for (const Entry& e : entries_) resident += e.loaded != nullptr;
  Entry e{name, resolved, unix_now(), nullptr, ++clock_};
  if (resident < max_resident_ || evict_one()) e.loaded = std::move(loaded);
  entries_.push_back(std::move(e));
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
  for (const Entry& e : entries_) out.push_back({e.name, e.path, e.created, e.loaded != nullptr});
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
  std::lock_guard lock(mu_);
  const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end()) return std::nullopt;
  it->last_used = ++clock_;
  if (it->loaded) return it->loaded;
  int64_t resident = 0;
  for (const Entry& e : entries_) resident += e.loaded != nullptr;
  if (resident >= max_resident_ && !evict_one()) return std::shared_ptr<const LoadedAdapter>();
  auto loaded = load(it->name, it->path);
  std::const_pointer_cast<LoadedAdapter>(loaded)->id = next_id_++;
  it->loaded = loaded;
  return loaded;
}

}  // namespace loom
