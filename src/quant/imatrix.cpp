#include "quant/imatrix.h"

#include <cmath>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "model/decoder.h"
#include "quant/observed_chunks.h"

namespace loom {
namespace {

const char* gguf_weight_name(LoraTarget t) {
  switch (t) {
    case LoraTarget::q: return "attn_q";
    case LoraTarget::k: return "attn_k";
    case LoraTarget::v: return "attn_v";
    case LoraTarget::o: return "attn_output";
    case LoraTarget::gate: return "ffn_gate";
    case LoraTarget::up: return "ffn_up";
    case LoraTarget::down: return "ffn_down";
  }
  return "?";
}

// Observes every linear layer's input through the decoder's adapter hook and
// sums its squares per column, in float and row order as llama-imatrix does.
class SquareCollector final : public LayerAdapters {
 public:
  SquareCollector(const ModelConfig& c, Imatrix& out) : out_(out) {
    slots_.resize(static_cast<size_t>(c.n_layers) * kLoraTargetCount);
    for (int64_t l = 0; l < c.n_layers; ++l)
      for (LoraTarget t : kAllLoraTargets) {
        const std::string name = "blk." + std::to_string(l) + "." + gguf_weight_name(t) + ".weight";
        Imatrix::Entry& e = out_.entries[name];
        e.sums.assign(static_cast<size_t>(lora_target_in(c, t)), 0.0f);
        e.counts.assign(1, 0);
        slots_[slot(l, t)] = &e;
      }
  }

  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    for (const AdapterJob& j : jobs) {
      Imatrix::Entry& e = *slots_[slot(layer, j.target)];
      const auto n = static_cast<int64_t>(e.sums.size());
      float* acc = e.sums.data();
      for (int64_t r = 0; r < j.rows; ++r) {
        const float* x = j.x + r * j.ldx;
        for (int64_t i = 0; i < n; ++i) acc[i] += x[i] * x[i];
      }
      e.counts[0] += j.rows;
      for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(acc[i]))
          fail(ErrorKind::invalid_input, "non-finite activations at the input of blk.{}.{}.weight", layer,
               gguf_weight_name(j.target));
    }
  }

 private:
  size_t slot(int64_t l, LoraTarget t) const {
    return static_cast<size_t>(l) * kLoraTargetCount + static_cast<size_t>(t);
  }
  Imatrix& out_;
  std::vector<Imatrix::Entry*> slots_;
};

template <typename T>
T read_pod(std::ifstream& in, const std::string& path, const char* what) {
  T v{};
  in.read(reinterpret_cast<char*>(&v), sizeof v);
  if (!in) fail(ErrorKind::invalid_input, "{}: the file ends inside {}", path, what);
  return v;
}

// The .dat form: i32 n_entries, then per entry (i32 name length, name, i32
// ncall, i32 nval, nval f32 sums), then optionally i32 chunks and a dataset name.
Imatrix load_legacy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorKind::not_found, "{}: cannot open the imatrix file", path);
  Imatrix m;
  m.legacy = true;
  const auto n = read_pod<int32_t>(in, path, "the entry count");
  if (n < 1 || n > (1 << 20)) fail(ErrorKind::invalid_input, "{}: not an imatrix file ({} entries)", path, n);
  for (int32_t i = 0; i < n; ++i) {
    const auto len = read_pod<int32_t>(in, path, "an entry name's length");
    if (len < 1 || len > 4096) fail(ErrorKind::invalid_input, "{}: entry {} has a name of {} bytes", path, i, len);
    std::string name(static_cast<size_t>(len), '\0');
    in.read(name.data(), len);
    const auto ncall = read_pod<int32_t>(in, path, "an entry's call count");
    const auto nval = read_pod<int32_t>(in, path, "an entry's value count");
    if (!in || nval < 1 || nval > (1 << 24))
      fail(ErrorKind::invalid_input, "{}: entry '{}' has {} values", path, name, nval);
    Imatrix::Entry& e = m.entries[name];
    e.sums.resize(static_cast<size_t>(nval));
    in.read(reinterpret_cast<char*>(e.sums.data()), static_cast<std::streamsize>(nval) * 4);
    if (!in) fail(ErrorKind::invalid_input, "{}: the file ends inside entry '{}'", path, name);
    e.counts.assign(1, ncall);
  }
  int32_t chunks = 0, len = 0;
  if (in.read(reinterpret_cast<char*>(&chunks), 4)) {
    m.chunk_count = chunks;
    if (in.read(reinterpret_cast<char*>(&len), 4) && len > 0 && len < 65536) {
      std::string ds(static_cast<size_t>(len), '\0');
      if (in.read(ds.data(), len)) m.datasets.push_back(ds);
    }
  }
  return m;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Imatrix load_gguf(const std::string& path) {
  const auto f = gguf::File::open(path);
  Imatrix m;
  if (f->find("imatrix.datasets") != nullptr) m.datasets = f->get_string_array("imatrix.datasets");
  m.chunk_count = static_cast<int64_t>(f->opt_uint("imatrix.chunk_count").value_or(0));
  m.chunk_size = static_cast<int64_t>(f->opt_uint("imatrix.chunk_size").value_or(0));
  std::map<std::string, std::pair<const gguf::TensorInfo*, const gguf::TensorInfo*>> parts;
  for (const auto& t : f->tensors()) {
    if (ends_with(t.name, ".in_sum2")) parts[t.name.substr(0, t.name.size() - 8)].first = &t;
    else if (ends_with(t.name, ".counts")) parts[t.name.substr(0, t.name.size() - 7)].second = &t;
  }
  if (parts.empty()) fail(ErrorKind::invalid_input, "{}: no imatrix entries (no *.in_sum2 tensors)", path);
  for (const auto& [name, p] : parts) {
    if (p.first == nullptr || p.second == nullptr)
      fail(ErrorKind::invalid_input, "{}: entry '{}' has {} but no {}", path, name,
           p.first ? "in_sum2" : "counts", p.first ? "counts" : "in_sum2");
    if (p.first->dtype != DType::f32 || p.second->dtype != DType::f32)
      fail(ErrorKind::invalid_input, "{}: entry '{}': in_sum2 and counts must be f32", path, name);
    Imatrix::Entry& e = m.entries[name];
    const size_t nval = p.first->nbytes / 4, ncount = p.second->nbytes / 4;
    if (ncount == 0 || nval % ncount != 0)
      fail(ErrorKind::invalid_input, "{}: entry '{}': {} sums do not split into {} matrices", path, name, nval, ncount);
    e.sums.resize(nval);
    std::memcpy(e.sums.data(), p.first->data, nval * 4);
    const auto* counts = reinterpret_cast<const float*>(p.second->data);
    for (size_t i = 0; i < ncount; ++i) e.counts.push_back(std::lround(counts[i]));
  }
  return m;
}

}  // namespace

std::map<std::string, std::vector<float>> Imatrix::importance() const {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, e] : entries) {
    std::vector<float>& v = out[name];
    v.resize(e.sums.size());
    if (legacy) {
      const int64_t ncall = e.counts.empty() ? 0 : e.counts[0];
      for (size_t i = 0; i < v.size(); ++i) v[i] = ncall > 0 ? e.sums[i] / static_cast<float>(ncall) : e.sums[i];
      continue;
    }
    const size_t per = e.sums.size() / e.counts.size();
    for (size_t m = 0; m < e.counts.size(); ++m) {
      const auto count = static_cast<float>(e.counts[m]);
      for (size_t i = 0; i < per; ++i) v[m * per + i] = count > 0 ? e.sums[m * per + i] / count : 1.0f;
    }
  }
  return out;
}

bool Imatrix::has_data() const {
  for (const auto& [name, e] : entries)
    for (int64_t c : e.counts)
      if (c > 0) return true;
  return false;
}

Imatrix load_imatrix(const std::string& path) {
  if (!std::ifstream(path, std::ios::binary)) fail(ErrorKind::not_found, "{}: cannot open the imatrix file", path);
  return gguf::is_gguf_file(path) ? load_gguf(path) : load_legacy(path);
}

void save_imatrix(const Imatrix& m, const std::string& path) {
  gguf::Writer w;
  w.set_string("general.type", "imatrix");
  w.set_string_array("imatrix.datasets", m.datasets);
  w.set_u32("imatrix.chunk_count", static_cast<uint32_t>(m.chunk_count));
  w.set_u32("imatrix.chunk_size", static_cast<uint32_t>(m.chunk_size));
  for (const auto& entry : m.entries) {  // std::map: sorted names, as llama-imatrix writes them
    // Named references, not a structured binding: clang before 16 (Debian 12's
    // 14) cannot capture a binding in the lambdas below.
    const std::string& name = entry.first;
    const auto& e = entry.second;
    const auto nmat = static_cast<int64_t>(e.counts.size());
    const auto per = static_cast<int64_t>(e.sums.size()) / nmat;
    w.add_tensor(name + ".in_sum2", DType::f32, {nmat, per},
                 [&e](uint8_t* dst) { std::memcpy(dst, e.sums.data(), e.sums.size() * 4); });
    w.add_tensor(name + ".counts", DType::f32, {nmat, 1}, [&e](uint8_t* dst) {
      for (size_t i = 0; i < e.counts.size(); ++i) {
        const auto c = static_cast<float>(e.counts[i]);
        std::memcpy(dst + 4 * i, &c, 4);
      }
    });
  }
  w.write(path);
}

Imatrix compute_imatrix(InferenceSession& session, const ModelConfig& config, std::span<const int32_t> tokens,
                        const ImatrixOptions& opt, const std::function<void(int64_t, int64_t)>& on_chunk) {
  const int64_t n_ctx = opt.n_ctx;
  const auto n_tokens = static_cast<int64_t>(tokens.size());
  if (n_ctx < 4 || session.n_ctx() < n_ctx)
    fail(ErrorKind::invalid_input, "imatrix: a chunk of {} tokens does not fit the session ({})", n_ctx,
         session.n_ctx());
  if (n_tokens < 2 * n_ctx)
    fail(ErrorKind::invalid_input,
         "the calibration text tokenizes to {} tokens; a context of {} needs at least {} (2 chunks)", n_tokens, n_ctx,
         2 * n_ctx);
  int64_t n_chunks = n_tokens / n_ctx;
  if (opt.max_chunks >= 0) n_chunks = std::min(n_chunks, opt.max_chunks);
  Imatrix m;
  m.chunk_size = n_ctx;
  SquareCollector collector(config, m);
  run_observed_chunks(session, tokens, n_ctx, n_chunks, opt.bos, collector, [&](int64_t c, int64_t n) {
    m.chunk_count = c;
    if (on_chunk) on_chunk(c, n);
  });
  return m;
}

}  // namespace loom
