// The BPE model of Hugging Face `tokenizers`: characters (or <0xXX> byte
// tokens) merged pairwise by merge rank, lowest rank first and leftmost on
// ties, exactly as its Word::merge_all does.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeOptions {
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  int32_t unk_id = -1;  // -1: unknown characters are dropped (as HF does without unk_token)
};

class BpeModel {
 public:
  BpeModel() = default;
  // `vocab`: id -> text (empty = unused id). Later duplicates of a text win, and a
  // repeated merge keeps its last rank, as in HF. Throws invalid_input naming
  // `what` and the merge index for a merge whose parts or result are not tokens.
  BpeModel(const std::vector<std::string>& vocab, const std::vector<std::pair<std::string, std::string>>& merges,
           const BpeOptions& opts, const std::string& what);

  // Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  int32_t find(std::string_view text) const;  // -1 if not a model token
  const TokenIndex& index() const { return index_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const Merge* find_merge(int32_t a, int32_t b) const {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  TokenIndex index_;
  std::unordered_map<uint64_t, Merge> merges_;
  BpeOptions opts_;
  int32_t byte_ids_[256] = {};  // <0xXX> ids, -1 when absent
};

}  // namespace loom::tok
