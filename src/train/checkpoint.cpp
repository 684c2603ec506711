// Checkpoint folders (see checkpoint.h): raw f32 arenas, state.json,
// config.yaml, metrics.jsonl and manifest.json (written last), staged and
// renamed into place by write_folder_atomic.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/file_write.h"

namespace loom {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

constexpr const char* kFormatName = "loom-checkpoint";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kParams = "params.f32";
constexpr const char* kAdamM = "adam_m.f32";  // AdamW::state_parts()' first two
constexpr const char* kAdamV = "adam_v.f32";
constexpr const char* kState = "state.json";
constexpr const char* kConfig = "config.yaml";
constexpr const char* kMetrics = "metrics.jsonl";

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

std::string_view bytes_of(std::span<const float> s) {
  return {reinterpret_cast<const char*>(s.data()), s.size() * sizeof(float)};
}

// FNV-1a 64 of a file's bytes (mapped, not copied).
uint64_t file_fnv(const std::string& path, uint64_t seed = 0xcbf29ce484222325ull) {
  std::error_code ec;
  if (fs::file_size(path, ec) == 0 && !ec) return seed;
  const MappedFile f(path);
  return fnv1a64({reinterpret_cast<const char*>(f.data()), f.size()}, seed);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: the folder's own creation only
  ::fsync(fd);
  ::close(fd);
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(); }
double number_or_nan(const json& j) { return j.is_number() ? j.get<double>() : std::nan(""); }

json state_json(const CheckpointState& st) {
  json ids = json::array();
  for (const auto& [k, v] : st.identity) ids.push_back({k, v});
  json hashes = json::object();
  for (const auto& [k, v] : st.input_hashes) hashes[k] = v;
  json losses = json::array();
  for (double l : st.step_losses) losses.push_back(number_or_null(l));
  json evals = json::array();
  for (const EvalPoint& e : st.evals)
    evals.push_back({{"step", e.step}, {"loss", number_or_null(e.loss)}, {"accuracy", number_or_null(e.accuracy)}});
  return {
      {"format_version", kCheckpointFormat},
      {"step", st.step},
      {"reason", st.reason},
      {"cursor", {{"epoch", st.cursor.epoch}, {"index", st.cursor.index}}},
      {"shuffle_seed", st.shuffle_seed},
      {"rng", {{"dropout", "counter-based: mask = f(dropout_seed, step * grad_accum + micro-batch, adapter stream, element); no other state"},
               {"dropout_seed", st.dropout_seed}}},
      {"schedule", {{"kind", lr_schedule_name(st.schedule.kind)}, {"warmup_steps", st.schedule.warmup_steps},
                    {"total_steps", st.schedule.total_steps}, {"num_cycles", st.schedule.num_cycles},
                    {"position", st.step}}},
      {"optimizer", {{"step", st.step}, {"moments", {kAdamM, kAdamV}}}},
      {"faults", {{"bad_in_a_row", st.faults.bad_in_a_row}, {"skipped_steps", st.faults.skipped_steps},
                  {"rollbacks", st.faults.rollbacks}, {"lr_scale", st.faults.lr_scale}}},
      {"run_identity", ids},
      {"input_hashes", hashes},
      {"metrics", {{"step_losses", losses}, {"evals", evals}, {"trained_tokens", st.trained_tokens},
                   {"input_tokens", st.input_tokens}, {"train_seconds", st.train_seconds},
                   {"elapsed_seconds", st.elapsed_seconds}}},
      {"rank", st.rank},
      {"world_size", st.world_size},
      {"tensor_parallel", st.tensor_parallel},
  };
}

CheckpointState state_from_json(const json& j) {
  CheckpointState st;
  st.step = j.at("step").get<int64_t>();
  st.reason = j.value("reason", "");
  st.cursor.epoch = j.at("cursor").at("epoch").get<int64_t>();
  st.cursor.index = j.at("cursor").at("index").get<int64_t>();
  st.shuffle_seed = j.at("shuffle_seed").get<uint64_t>();
  st.dropout_seed = j.at("rng").at("dropout_seed").get<uint64_t>();
  const json& s = j.at("schedule");
  st.schedule.kind = lr_schedule_from_name(s.at("kind").get<std::string>());
  st.schedule.warmup_steps = s.at("warmup_steps").get<int64_t>();
  st.schedule.total_steps = s.at("total_steps").get<int64_t>();
  st.schedule.num_cycles = s.at("num_cycles").get<double>();
  const json& f = j.at("faults");
  st.faults.bad_in_a_row = f.at("bad_in_a_row").get<int64_t>();
  st.faults.skipped_steps = f.at("skipped_steps").get<int64_t>();
  st.faults.rollbacks = f.at("rollbacks").get<int64_t>();
  st.faults.lr_scale = f.at("lr_scale").get<double>();
  if (j.contains("loss_scaler")) {
    const json& ls = j.at("loss_scaler");
    st.loss_scaler = LossScalerState{ls.at("scale").get<float>(), ls.at("growth_tracker").get<int64_t>()};
  }
  for (const json& p : j.at("run_identity")) st.identity.emplace_back(p.at(0).get<std::string>(), p.at(1).get<std::string>());
  for (const auto& [k, v] : j.at("input_hashes").items()) st.input_hashes.emplace_back(k, v.get<std::string>());
  const json& m = j.at("metrics");
  for (const json& l : m.at("step_losses")) st.step_losses.push_back(number_or_nan(l));
  for (const json& e : m.at("evals"))
    st.evals.push_back({e.at("step").get<int64_t>(), number_or_nan(e.at("loss")),
                        number_or_nan(e.value("accuracy", json()))});
  st.trained_tokens = m.at("trained_tokens").get<int64_t>();
  st.input_tokens = m.at("input_tokens").get<int64_t>();
  st.train_seconds = m.at("train_seconds").get<double>();
  st.elapsed_seconds = m.at("elapsed_seconds").get<double>();
  st.rank = j.value("rank", 0);
  st.world_size = j.value("world_size", 1);
  st.tensor_parallel = j.value("tensor_parallel", 1);  // absent before tensor parallel wrote checkpoints
  return st;
}

json read_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "{}: invalid JSON: {}", path, e.what());
  }
}

// The manifest's entry for `name`, or nullptr.
const json* manifest_file(const json& manifest, std::string_view name) {
  for (const json& f : manifest.at("files"))
    if (f.at("name").get<std::string>() == name) return &f;
  return nullptr;
}

// Why the manifest's files do not match the folder, or "".
std::string check_files(const fs::path& dir, const json& manifest) {
  for (const char* need : {kParams, kAdamM, kAdamV, kState, kConfig})
    if (!manifest_file(manifest, need)) return fmt::format("manifest.json does not list {}", need);
  for (const json& f : manifest.at("files")) {
    const std::string name = f.at("name").get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name.starts_with("."))
      return fmt::format("manifest.json lists a bad file name '{}'", name);
    const fs::path p = dir / name;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec) return fmt::format("{} is missing", name);
    const auto want = f.at("bytes").get<uint64_t>();
    if (size != want) return fmt::format("{} has {} bytes, the manifest says {} (truncated?)", name, size, want);
    const std::string sum = hex64(file_fnv(p.string()));
    if (sum != f.at("fnv1a64").get<std::string>())
      return fmt::format("{}: checksum {} differs from the manifest's {} (corrupted)", name, sum,
                         f.at("fnv1a64").get<std::string>());
  }
  return "";
}

// Reads a raw f32 file of exactly dst.size() floats into dst.
void read_floats(const fs::path& p, std::span<float> dst, std::string_view what) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  if (ec) fail(ErrorKind::io, "{}: cannot read: {}", p.string(), ec.message());
  if (size != dst.size_bytes())
    fail(ErrorKind::invalid_input, "{}: holds {} {} values, this run has {} (another model, method or LoRA shape)",
         p.string(), size / sizeof(float), what, dst.size());
  if (dst.empty()) return;
  const MappedFile f(p.string());
  std::memcpy(dst.data(), f.data(), dst.size_bytes());
}

// Reads bytes [offset, offset + bytes) of a raw file of exactly `total` bytes into dst.
void read_bytes(const fs::path& p, void* dst, size_t bytes, size_t offset, size_t total, std::string_view what) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  if (ec) fail(ErrorKind::io, "{}: cannot read: {}", p.string(), ec.message());
  if (size != total)
    fail(ErrorKind::invalid_input, "{}: holds {} bytes of {}, this run has {} (another model, method or LoRA shape)",
         p.string(), size, what, total);
  LOOM_ASSERT(offset + bytes <= total);
  if (bytes == 0) return;
  const MappedFile f(p.string());
  std::memcpy(dst, f.data() + offset, bytes);
}

}  // namespace

std::optional<double> CheckpointState::eval_loss() const {
  for (auto it = evals.rbegin(); it != evals.rend(); ++it)
    if (it->step <= step && std::isfinite(it->loss)) return it->loss;
  return std::nullopt;
}

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::optional<int64_t> checkpoint_step(std::string_view name) {
  if (!name.starts_with("step-") || name.size() < 13 || name.size() > 23) return std::nullopt;
  int64_t v = 0;
  for (char ch : name.substr(5)) {
    if (ch < '0' || ch > '9') return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  return v;
}

CheckpointWriteInfo write_checkpoint(const std::string& dir, const CheckpointState& st, std::span<const float> params,
                                     const AdamW& opt, const std::function<void(std::string_view)>& on_stage) {
  LOOM_ASSERT(st.step == opt.step_count());
  LOOM_ASSERT(opt.n_params() == params.size());
  const std::vector<AdamW::StatePart> parts = opt.state_parts();
  return write_checkpoint(dir, st, params, opt.kind(), parts, on_stage);
}

CheckpointWriteInfo write_checkpoint(const std::string& dir, const CheckpointState& st, std::span<const float> params,
                                     OptimizerKind kind, std::span<const AdamW::StatePart> parts,
                                     const std::function<void(std::string_view)>& on_stage,
                                     std::span<const AdamW::StatePart> extra) {
  for (const AdamW::StatePart& p : parts) LOOM_ASSERT(p.file_offset == 0 && p.bytes == p.file_bytes);  // whole
  const auto t0 = std::chrono::steady_clock::now();
  const auto stage = [&](std::string_view s) {
    if (on_stage) on_stage(s);
  };
  std::error_code ec;
  const fs::path root = fs::absolute(dir).lexically_normal();
  if (!fs::is_directory(root, ec)) {
    fs::create_directories(root, ec);
    if (ec) fail(ErrorKind::io, "checkpoint_dir '{}': cannot create the folder: {}", dir, ec.message());
    fsync_dir(root.parent_path());
  }
  CheckpointWriteInfo info;
  info.path = (root / checkpoint_name(st.step)).string();
  FolderWriteOptions o;
  o.overwrite = true;  // a checkpoint of the same step (after a rollback) is replaced as a whole
  o.what = "checkpoint";
  write_folder_atomic(info.path, [&](const std::string& staging) {
    json files = json::array();
    const auto put = [&](const char* name, std::string_view bytes) {
      write_file_atomic(staging + "/" + name, bytes);
      files.push_back({{"name", name}, {"bytes", bytes.size()}, {"fnv1a64", hex64(fnv1a64(bytes))}});
      info.bytes += static_cast<int64_t>(bytes.size());
    };
    put(kParams, bytes_of(params));
    // adam_m.f32, adam_v.f32 and, for adamw8bit, the codes and absmax of its 8-bit moments.
    json state = state_json(st), moments = json::array();
    for (const AdamW::StatePart& part : parts) {
      put(part.file, {static_cast<const char*>(part.data), part.bytes});
      moments.push_back(part.file);
    }
    if (st.loss_scaler)
      state["loss_scaler"] = {{"scale", st.loss_scaler->scale}, {"growth_tracker", st.loss_scaler->growth_tracker}};
    state["optimizer"]["kind"] = optimizer_kind_name(kind);
    state["optimizer"]["moments"] = moments;
    put(kState, state.dump(1) + "\n");
    put(kConfig, st.config_text);
    put(kMetrics, st.metrics_text);
    for (const AdamW::StatePart& part : extra) put(part.file, {static_cast<const char*>(part.data), part.bytes});
    stage("files_written");
    const std::optional<double> ev = st.eval_loss();
    const json manifest = {{"format", kFormatName}, {"format_version", kCheckpointFormat}, {"step", st.step},
                           {"rank", st.rank},       {"world_size", st.world_size},
                           {"eval_loss", ev ? json(*ev) : json()}, {"files", files}};
    const std::string text = manifest.dump(1) + "\n";
    write_file_atomic(staging + "/" + kManifest, text);  // last: its presence means every file above is complete
    info.bytes += static_cast<int64_t>(text.size());
    stage("manifest_written");
  }, o);
  stage("renamed");
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return info;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto step = checkpoint_step(e.path().filename().string());
    if (step && e.is_directory(ec)) found.emplace_back(*step, e.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

std::string verify_checkpoint(const std::string& path) {
  const fs::path dir(path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "not a folder";
  if (!fs::exists(dir / kManifest, ec)) return "no manifest.json (its write did not finish)";
  try {
    const json m = read_json_file((dir / kManifest).string());
    if (m.value("format", "") != kFormatName) return "manifest.json is not a loom checkpoint manifest";
    const int version = m.at("format_version").get<int>();
    if (version != kCheckpointFormat)
      return fmt::format("checkpoint format {} (this build reads {})", version, kCheckpointFormat);
    const auto named = checkpoint_step(dir.filename().string());
    if (named && *named != m.at("step").get<int64_t>())
      return fmt::format("manifest.json says step {}, the folder name step {}", m.at("step").get<int64_t>(), *named);
    if (std::string why = check_files(dir, m); !why.empty()) return why;
    const CheckpointState st = state_from_json(read_json_file((dir / kState).string()));
    if (st.step != m.at("step").get<int64_t>()) return "state.json and manifest.json disagree on the step";
  } catch (const std::exception& e) {  // loom::Error or a missing / mistyped JSON field
    return fmt::format("unreadable: {}", e.what());
  }
  return "";
}

std::optional<std::string> latest_good_checkpoint(const std::string& dir, std::vector<SkippedCheckpoint>& skipped) {
  for (const std::string& p : list_checkpoints(dir)) {
    std::string why = verify_checkpoint(p);
    if (why.empty()) return p;
    skipped.push_back({p, std::move(why)});
  }
  return std::nullopt;
}

CheckpointState read_checkpoint_state(const std::string& path) {
  const fs::path dir(path);
  CheckpointState st;
  try {
    st = state_from_json(read_json_file((dir / kState).string()));
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "{}: state.json: {}", path, e.what());
  }
  st.config_text = read_text_file((dir / kConfig).string());
  std::error_code ec;
  if (fs::exists(dir / kMetrics, ec)) st.metrics_text = read_text_file((dir / kMetrics).string());
  return st;
}

namespace {
// Throws invalid_input when the checkpoint's optimizer kind is not `opt`'s.
void check_optimizer_kind(const std::string& path, const AdamW& opt) {
  // Checkpoints from before adamw8bit name no kind: adamw.
  const json state = read_json_file((fs::path(path) / kState).string());
  const std::string kind = state.value("optimizer", json::object()).value("kind", "adamw");
  if (kind != optimizer_kind_name(opt.kind()))
    fail(ErrorKind::invalid_input, "{}: the checkpoint's optimizer state is optim.kind {}, this run uses {}", path,
         kind, optimizer_kind_name(opt.kind()));
}

// An optional state part a checkpoint does not hold (written by a run without
// it, e.g. before dist.compression topk was switched on): zeros.
bool absent_and_zeroed(const fs::path& dir, const AdamW::StatePart& part) {
  std::error_code ec;
  if (!part.zero_if_absent || fs::exists(dir / part.file, ec)) return false;
  std::memset(part.data, 0, part.bytes);
  return true;
}
}  // namespace

void load_checkpoint_arenas(const std::string& path, std::span<float> params, AdamW& opt) {
  const fs::path dir(path);
  const CheckpointState st = read_checkpoint_state(path);
  check_optimizer_kind(path, opt);
  read_floats(dir / kParams, params, "parameter");
  for (const AdamW::StatePart& part : opt.state_parts()) {  // a ZeRO-1 shard reads its run
    if (absent_and_zeroed(dir, part)) continue;
    read_bytes(dir / part.file, part.data, part.bytes, part.file_offset, part.file_bytes, "optimizer state");
  }
  opt.set_step_count(st.step);
}

void load_checkpoint_arenas(const std::string& path, std::span<float> params, AdamW& opt, size_t whole_size,
                            const std::function<void(std::span<const float>, std::span<float>)>& take) {
  LOOM_ASSERT(opt.kind() == OptimizerKind::adamw);
  const fs::path dir(path);
  const CheckpointState st = read_checkpoint_state(path);
  check_optimizer_kind(path, opt);
  std::vector<float> whole(whole_size);
  read_floats(dir / kParams, whole, "parameter");
  take(whole, params);
  std::vector<float> state(params.size());  // a moment in this rank's layout, of which ZeRO-1 keeps a run
  for (const AdamW::StatePart& part : opt.state_parts()) {  // adamw: m and v, one float per parameter
    LOOM_ASSERT(part.file_bytes == params.size_bytes() && part.file_offset + part.bytes <= part.file_bytes);
    if (absent_and_zeroed(dir, part)) continue;
    read_floats(dir / part.file, whole, "optimizer state");
    take(whole, state);
    std::memcpy(part.data, reinterpret_cast<const char*>(state.data()) + part.file_offset, part.bytes);
  }
  opt.set_step_count(st.step);
}

void check_run_identity(const RunIdentity& saved, const RunIdentity& now, const std::string& checkpoint) {
  const auto find = [](const RunIdentity& id, const std::string& key) -> std::optional<std::string> {
    for (const auto& [k, v] : id)
      if (k == key) return v;
    return std::nullopt;
  };
  const auto refuse = [&](const std::string& key, const std::string& was, const std::string& is) {
    fail(ErrorKind::invalid_input,
         "--resume {}: the config changes '{}' from '{}' (the checkpoint's run) to '{}'; a resumed run must keep "
         "it: restore the key, or start a new run (another output_dir, or --overwrite)",
         checkpoint, key, was, is);
  };
  for (const auto& [k, v] : now) {
    const auto old = find(saved, k);
    if (!old) refuse(k, "(not recorded)", v);
    if (*old != v) refuse(k, *old, v);
  }
  for (const auto& [k, v] : saved)
    if (!find(now, k)) refuse(k, v, "(not a key of this build)");
}

std::vector<std::string> prune_checkpoints(const std::string& dir, int64_t keep) {
  std::vector<std::string> removed;
  std::error_code ec;
  // Staging folders of writers that died (".step-XXXXXXXX.loom-new-PID-..."): finished by recover_folder_write.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto at = name.find(".loom-");
    if (!name.starts_with(".step-") || at == std::string::npos) continue;
    const std::string dest = name.substr(1, at - 1);
    if (checkpoint_step(dest)) recover_folder_write((fs::path(dir) / dest).string());
  }
  const std::vector<std::string> all = list_checkpoints(dir);
  // The best by eval loss (the newest among equals), read from the manifests.
  std::optional<size_t> best;
  double best_loss = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < all.size(); ++i) {
    try {
      const json m = read_json_file((fs::path(all[i]) / kManifest).string());
      const json& ev = m.at("eval_loss");
      if (ev.is_number() && ev.get<double>() < best_loss) {
        best_loss = ev.get<double>();
        best = i;
      }
    } catch (const std::exception&) {  // a bad checkpoint is never the best
    }
  }
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep, 0)); i < all.size(); ++i) {
    if (best && i == *best) continue;
    fs::remove_all(all[i], ec);
    if (!ec) removed.push_back(all[i]);
  }
  return removed;
}

std::string hash_path(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    if (!fs::exists(path, ec)) fail(ErrorKind::not_found, "{}: no such file", path);
    return hex64(file_fnv(path));
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(path, ec))
    if (e.is_regular_file()) files.push_back(e.path());
  if (ec) fail(ErrorKind::io, "{}: cannot list the folder: {}", path, ec.message());
  std::sort(files.begin(), files.end());
  uint64_t h = 0xcbf29ce484222325ull;
  for (const fs::path& f : files) {
    const std::string rel = f.lexically_relative(path).string();
    h = fnv1a64(std::string_view(rel.c_str(), rel.size() + 1), h);  // the name and its NUL
    h = file_fnv(f.string(), h);
  }
  return hex64(h);
}

}  // namespace loom
