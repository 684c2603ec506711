// On-disk cache of tokenized datasets (see data.h). One file per key: a fixed
// header (magic, version, 128-bit key, counts, stats), the flat sample arrays
// and a trailing checksum. Every field is checked on load; a file that fails
// any check is ignored and rebuilt.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <system_error>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/rng.h"
#include "io/file_write.h"
#include "train/data.h"

namespace loom {
namespace {

constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', 'S'};
// Bump when the file layout or anything that decides ids/labels changes.
constexpr uint32_t kCacheVersion = 1;

// 128-bit streaming hash (two splitmix lanes over 8-byte words). Not
// cryptographic: it tells apart datasets and settings, it does not resist forgery.
class Hasher {
 public:
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      word(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, p + i, n - i);
    word(tail ^ (static_cast<uint64_t>(n - i) << 56));
  }
  void u64(uint64_t v) { word(v); }
  void str(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  std::pair<uint64_t, uint64_t> digest() const { return {splitmix64(a_ ^ n_), splitmix64(b_ + n_)}; }

 private:
  void word(uint64_t w) {
    a_ = splitmix64(a_ ^ w);
    b_ = splitmix64(b_ + w * 0x9e3779b97f4a7c15ull) ^ a_;
    ++n_;
  }
  uint64_t a_ = 0x243f6a8885a308d3ull, b_ = 0x13198a2e03707344ull, n_ = 0;
};

using Key = std::pair<uint64_t, uint64_t>;

Key dataset_key(std::string_view file_bytes, const Tokenizer& tok, const ChatTemplate* tmpl,
                const DataOptions& opt) {
  Hasher h;
  h.u64(kCacheVersion);
  h.str(file_bytes);
  h.u64(tokenizer_fingerprint(tok));
  h.u64(tmpl != nullptr);
  if (tmpl) {
    h.u64(static_cast<uint64_t>(tmpl->kind));
    h.str(tmpl->default_system);
    h.str(tmpl->bos);
    h.str(tmpl->eos);
  }
  h.u64(static_cast<uint64_t>(opt.format));
  h.u64(static_cast<uint64_t>(opt.seq_len));
  h.u64(opt.train_on_prompt);
  h.u64(opt.skip_bad_lines);
  h.u64(opt.parse_special);
  return h.digest();
}

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  uint64_t key[2];
  int64_t n_samples, n_tokens;
  int64_t stats[8];
  int64_t n_examples;
};
static_assert(sizeof(Header) == 8 + 8 + 16 + 16 + 64 + 8);

void stats_to(const DataStats& s, int64_t* f) {
  const int64_t v[8] = {s.lines, s.blank_lines, s.samples, s.skipped, s.truncated, s.dropped, s.tokens,
                        s.masked_tokens};
  std::memcpy(f, v, sizeof v);
}
void stats_from(const int64_t* f, DataStats& s) {
  s.lines = f[0], s.blank_lines = f[1], s.samples = f[2], s.skipped = f[3];
  s.truncated = f[4], s.dropped = f[5], s.tokens = f[6], s.masked_tokens = f[7];
}

class Writer {
 public:
  void raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  template <typename T>
  void pod(const T& v) { raw(&v, sizeof v); }
  std::string& buf() { return buf_; }

 private:
  std::string buf_;
};

// Bounds-checked reads; a failed check sets `error` and returns false.
class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  bool raw(void* p, size_t n) {
    if (n > b_.size() - pos_) return false;
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool pod(T& v) { return raw(&v, sizeof v); }
  size_t left() const { return b_.size() - pos_; }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

std::string serialize(const Key& key, const SampleSet& set, const DataStats& stats) {
  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = kCacheVersion;
  h.key[0] = key.first, h.key[1] = key.second;
  h.n_samples = set.size();
  h.n_tokens = static_cast<int64_t>(set.ids.size());
  stats_to(stats, h.stats);
  h.n_examples = static_cast<int64_t>(stats.skipped_examples.size());
  Writer w;
  w.pod(h);
  for (const std::string& e : stats.skipped_examples) {
    w.pod(static_cast<uint64_t>(e.size()));
    w.raw(e.data(), e.size());
  }
  w.raw(set.offsets.data(), set.offsets.size() * sizeof(int64_t));
  w.raw(set.ids.data(), set.ids.size() * sizeof(int32_t));
  w.raw(set.labels.data(), set.labels.size() * sizeof(int32_t));
  Hasher sum;
  sum.str(w.buf());
  w.pod(sum.digest().first);
  return std::move(w.buf());
}

// The cached samples, or the reason the file cannot be used.
std::optional<SampleSet> deserialize(std::string_view b, const Key& key, const Tokenizer& tok, int64_t seq_len,
                                     DataStats& stats, std::string& why) {
  if (b.size() < sizeof(Header) + 8) return why = "file too short", std::nullopt;
  {
    Hasher sum;
    sum.str(b.substr(0, b.size() - 8));
    uint64_t stored;
    std::memcpy(&stored, b.data() + b.size() - 8, 8);
    if (stored != sum.digest().first) return why = "checksum mismatch", std::nullopt;
  }
  Reader r(b.substr(0, b.size() - 8));
  Header h;
  r.pod(h);
  if (std::memcmp(h.magic, kMagic, 8) != 0) return why = "not a loom token cache", std::nullopt;
  if (h.version != kCacheVersion) return why = fmt::format("cache version {}", h.version), std::nullopt;
  if (h.key[0] != key.first || h.key[1] != key.second) return why = "key mismatch", std::nullopt;
  if (h.n_samples < 1 || h.n_tokens < h.n_samples || h.n_examples < 0 || h.n_examples > 1000)
    return why = "bad counts", std::nullopt;
  DataStats st;
  stats_from(h.stats, st);
  if (st.samples != h.n_samples || st.tokens != h.n_tokens) return why = "stats disagree with data", std::nullopt;
  for (int64_t i = 0; i < h.n_examples; ++i) {
    uint64_t n;
    if (!r.pod(n) || n > r.left()) return why = "truncated", std::nullopt;
    std::string e(n, '\0');
    r.raw(e.data(), n);
    st.skipped_examples.push_back(std::move(e));
  }
  const size_t want = (h.n_samples + 1) * sizeof(int64_t) + 2 * h.n_tokens * sizeof(int32_t);
  if (r.left() != want) return why = "size disagrees with header", std::nullopt;
  SampleSet set;
  set.offsets.resize(h.n_samples + 1);
  set.ids.resize(h.n_tokens);
  set.labels.resize(h.n_tokens);
  r.raw(set.offsets.data(), set.offsets.size() * sizeof(int64_t));
  r.raw(set.ids.data(), set.ids.size() * sizeof(int32_t));
  r.raw(set.labels.data(), set.labels.size() * sizeof(int32_t));
  if (set.offsets[0] != 0 || set.offsets.back() != h.n_tokens) return why = "bad offsets", std::nullopt;
  for (int64_t i = 0; i < h.n_samples; ++i)
    if (set.length(i) < 1 || set.length(i) > seq_len) return why = "bad sample length", std::nullopt;
  const int32_t vocab = tok.vocab_size();
  for (int64_t t = 0; t < h.n_tokens; ++t) {
    const int32_t id = set.ids[t], label = set.labels[t];
    if (id < 0 || id >= vocab || (label != kIgnoreLabel && label != id)) return why = "bad token", std::nullopt;
  }
  stats = std::move(st);
  return set;
}

std::string key_hex(const Key& k) { return fmt::format("{:016x}{:016x}", k.first, k.second); }

// Writes through a temporary file and a rename, so a reader never sees half a file.

}  // namespace

uint64_t tokenizer_fingerprint(const Tokenizer& tok) {
  const TokenizerSpec& s = tok.spec();
  Hasher h;
  h.u64(static_cast<uint64_t>(s.kind));
  h.u64(s.vocab.size());
  for (const auto& v : s.vocab) h.str(v);
  h.u64(s.merges.size());
  for (const auto& [a, b] : s.merges) h.str(a), h.str(b);
  h.u64(s.byte_fallback | s.fuse_unk << 1 | s.ignore_merges << 2 | s.add_bos << 3 | s.add_eos << 4);
  h.str(s.unk_token.value_or("\x01none"));
  h.u64(s.added_tokens.size());
  for (const AddedToken& t : s.added_tokens) {
    h.u64(static_cast<uint64_t>(t.id));
    h.str(t.content);
    h.u64(t.special | t.single_word << 1 | t.lstrip << 2 | t.rstrip << 3 | t.normalized << 4);
  }
  h.u64(s.normalizers.size());
  for (const NormalizerStep& n : s.normalizers) {
    h.u64(static_cast<uint64_t>(n.kind) | n.pattern_is_regex << 8);
    h.str(n.pattern), h.str(n.content);
  }
  h.u64(s.pre_tokenizers.size());
  for (const PreTokenizerStep& p : s.pre_tokenizers) {
    h.u64(static_cast<uint64_t>(p.kind) | p.pattern_is_regex << 8 | static_cast<uint64_t>(p.behavior) << 9 |
          p.invert << 13 | p.add_prefix_space << 14 | p.use_regex << 15 | p.individual_digits << 16 |
          static_cast<uint64_t>(p.prepend_scheme) << 17 | static_cast<uint64_t>(p.split) << 20);
    h.str(p.pattern), h.str(p.replacement);
  }
  for (int32_t id : {s.bos_id, s.eos_id, s.unk_id, s.pad_id}) h.u64(static_cast<uint64_t>(static_cast<int64_t>(id)));
  h.u64(s.eog_ids.size());
  for (int32_t id : s.eog_ids) h.u64(static_cast<uint64_t>(id));
  return h.digest().first;
}

const char* cache_status_name(CacheInfo::Status s) {
  switch (s) {
    case CacheInfo::Status::disabled:
      return "disabled";
    case CacheInfo::Status::hit:
      return "hit";
    case CacheInfo::Status::built:
      return "built";
    case CacheInfo::Status::rebuilt:
      return "rebuilt";
  }
  return "?";
}

std::string dataset_cache_path(const std::string& cache_dir, std::string_view file_bytes, const Tokenizer& tok,
                               const ChatTemplate* tmpl, const DataOptions& opt) {
  return (std::filesystem::path(cache_dir) / ("tokens-" + key_hex(dataset_key(file_bytes, tok, tmpl, opt)) + ".bin"))
      .string();
}

SampleSet load_jsonl_dataset(const std::string& path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt, DataStats& stats, CacheInfo& cache) {
  cache = {};
  if (opt.cache_dir.empty()) return read_jsonl_dataset(path, tok, tmpl, opt, stats);
  const std::string bytes = read_text_file(path);
  const Key key = dataset_key(bytes, tok, tmpl, opt);
  cache.path = (std::filesystem::path(opt.cache_dir) / ("tokens-" + key_hex(key) + ".bin")).string();
  cache.status = CacheInfo::Status::built;
  std::error_code ec;
  if (std::filesystem::exists(cache.path, ec)) {
    std::string why;
    try {
      const std::string cached = read_text_file(cache.path);
      if (auto set = deserialize(cached, key, tok, opt.seq_len, stats, why)) {
        cache.status = CacheInfo::Status::hit;
        return std::move(*set);
      }
    } catch (const Error& e) {
      why = e.what();
    }
    cache.status = CacheInfo::Status::rebuilt;
    cache.reason = why;
  }
  SampleSet set = read_jsonl_text(bytes, path, tok, tmpl, opt, stats);
  if (opt.cache_read_only) {
    cache.reason += (cache.reason.empty() ? "" : "; ") + std::string("not written (read only)");
    return set;
  }
  try {
    write_file_atomic(cache.path, serialize(key, set, stats));
  } catch (const Error& e) {  // an unwritable cache is reported, not fatal
    cache.reason += (cache.reason.empty() ? "" : "; ") + std::string(e.what());
  }
  return set;
}

}  // namespace loom
