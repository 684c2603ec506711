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

// Working memory for encode_word, reused across the words of one encode call
// (a word cache included) so that a long text does not allocate per word.
struct BpeScratch {
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
      cache;  // word -> ids span
  std::vector<int32_t> cached_ids;
};

class BpeModel {
 public:
  BpeModel() = default;
  // `vocab`: id -> text (empty = unused id). Later duplicates of a text win, and a
  // repeated merge keeps its last rank, as in HF. Throws invalid_input naming
  // `what` and the merge index for a merge whose parts or result are not tokens.
  BpeModel(const std::vector<std::string>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& opts,
           const std::string& what);

  // Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<int32_t>& out, BpeScratch& scratch) const;

  int32_t find(std::string_view text) const;  // -1 if not a model token
  const TokenIndex& index() const { return index_; }

 private:
  struct Merge {
    int32_t rank = -1;
    int32_t new_id = -1;
  };
  // Open-addressing map (pair of ids) -> merge: the hot lookup of encoding.
  class MergeTable {
   public:
    void reserve(size_t n);
    void set(int32_t a, int32_t b, Merge m);
    const Merge* find(int32_t a, int32_t b) const;

   private:
    static uint64_t key(int32_t a, int32_t b) {
      return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
    }
    size_t slot(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_); }
    std::vector<uint64_t> keys_;  // kEmpty where free
    std::vector<Merge> values_;
    int shift_ = 64;
    size_t size_ = 0;
  };

  void merge_word(std::string_view word, std::vector<int32_t>& out, BpeScratch& scratch) const;
  int32_t char_id(std::string_view ch) const;

  TokenIndex index_;
  MergeTable merges_;
  BpeOptions opts_;
  int32_t byte_ids_[256] = {};  // <0xXX> ids, -1 when absent
  std::vector<int32_t>
      small_chars_;  // id of each code point below 0x800 as a one-character token, -1 if none
};

}  // namespace loom::tok
