// BPE merging (see bpe.h). The heap discipline, the stale-entry check and the
// unknown/byte-fallback handling follow HF `tokenizers` step by step, because
// any deviation changes ids on some input.
#include "tokenizer/bpe.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace loom::tok {
namespace {

constexpr uint64_t kEmpty = ~uint64_t{0};  // no pair of non-negative ids has this key
constexpr size_t kCacheMaxWord = 64;       // bytes; longer words are rare and not worth keeping
constexpr size_t kCacheMaxEntries = 1 << 16;

// Max-heap order: the candidate with the lowest rank, then the leftmost, on top.
bool lower_priority(const BpeScratch::Candidate& a, const BpeScratch::Candidate& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
}

}  // namespace

void BpeModel::MergeTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  keys_.assign(cap, kEmpty);
  values_.assign(cap, Merge{});
  shift_ = 64 - __builtin_ctzll(cap);
  size_ = 0;
}

void BpeModel::MergeTable::set(int32_t a, int32_t b, Merge m) {
  LOOM_ASSERT(2 * (size_ + 1) <= keys_.size());
  const uint64_t k = key(a, b);
  for (size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
    if (keys_[i] == k) {  // a repeated merge: the later rank wins, as in HF's map
      values_[i] = m;
      return;
    }
    if (keys_[i] == kEmpty) {
      keys_[i] = k;
      values_[i] = m;
      ++size_;
      return;
    }
  }
}

const BpeModel::Merge* BpeModel::MergeTable::find(int32_t a, int32_t b) const {
  if (keys_.empty()) return nullptr;
  const uint64_t k = key(a, b);
  for (size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
    if (keys_[i] == k) return &values_[i];
    if (keys_[i] == kEmpty) return nullptr;
  }
}

BpeModel::BpeModel(const std::vector<std::string>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& opts,
                   const std::string& what)
    : opts_(opts) {
  index_.reserve(vocab.size());
  for (size_t i = 0; i < vocab.size(); ++i)
    if (!vocab[i].empty()) index_[vocab[i]] = static_cast<int32_t>(i);
  for (int b = 0; b < 256; ++b) byte_ids_[b] = find(fmt::format("<0x{:02X}>", b));
  small_chars_.resize(0x800);
  std::string ch;
  for (char32_t cp = 0; cp < 0x800; ++cp) {
    ch.clear();
    utf8_append(ch, cp);
    small_chars_[cp] = find(ch);
  }
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    const int32_t ia = find(a), ib = find(b);
    if (ia < 0 || ib < 0)
      fail(ErrorKind::invalid_input, "{}: merges[{}]: token {:?} is not in the vocabulary", what, r,
           ia < 0 ? a : b);
    joined.assign(a).append(b);
    const int32_t inew = find(joined);
    if (inew < 0)
      fail(ErrorKind::invalid_input, "{}: merges[{}]: the merged token {:?} is not in the vocabulary", what,
           r, joined);
    merges_.set(ia, ib, Merge{static_cast<int32_t>(r), inew});
  }
}

int32_t BpeModel::find(std::string_view text) const {
  auto it = index_.find(text);
  return it == index_.end() ? -1 : it->second;
}

int32_t BpeModel::char_id(std::string_view ch) const {
  const auto b0 = static_cast<uint8_t>(ch[0]);
  if (ch.size() == 1) return small_chars_[b0];
  if (ch.size() == 2) return small_chars_[((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(ch[1]) & 0x3Fu)];
  return find(ch);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out, BpeScratch& scratch) const {
  if (word.empty()) return;
  if (opts_.ignore_merges) {
    if (const int32_t id = find(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (word.size() > kCacheMaxWord) {
    merge_word(word, out, scratch);
    return;
  }
  if (auto it = scratch.cache.find(word); it != scratch.cache.end()) {
    const auto [at, n] = it->second;
    out.insert(out.end(), scratch.cached_ids.begin() + at, scratch.cached_ids.begin() + at + n);
    return;
  }
  const size_t before = out.size();
  merge_word(word, out, scratch);
  if (scratch.cache.size() < kCacheMaxEntries) {
    const auto at = static_cast<uint32_t>(scratch.cached_ids.size());
    scratch.cached_ids.insert(scratch.cached_ids.end(), out.begin() + static_cast<std::ptrdiff_t>(before),
                              out.end());
    scratch.cache.emplace(std::string(word), std::make_pair(at, static_cast<uint32_t>(out.size() - before)));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out, BpeScratch& scratch) const {
  using Symbol = BpeScratch::Symbol;
  using Candidate = BpeScratch::Candidate;
  // Initial symbols: one per character, a run of <0xXX> tokens for a character
  // not in the vocabulary (byte fallback), else the unknown token (fused if asked).
  std::vector<Symbol>& sym = scratch.symbols;
  sym.clear();
  const auto add = [&](int32_t id) {
    const int32_t n = static_cast<int32_t>(sym.size());
    sym.push_back(Symbol{id, n - 1, n + 1, true});
  };
  bool unk_pending = false;
  for (size_t i = 0; i < word.size();) {
    char32_t cp;
    size_t bad;
    size_t n = utf8_decode(word, i, cp, bad);
    if (n == 0) n = bad;  // cannot happen on sanitised text; keep going byte-wise
    const std::string_view ch = word.substr(i, n);
    i += n;
    if (const int32_t id = char_id(ch); id >= 0) {
      if (unk_pending) {
        add(opts_.unk_id);
        unk_pending = false;
      }
      add(id);
      continue;
    }
    if (opts_.byte_fallback) {
      bool all = true;
      for (unsigned char b : ch) all = all && byte_ids_[b] >= 0;
      if (all) {
        // HF adds these without flushing a pending unknown token first.
        for (unsigned char b : ch) add(byte_ids_[b]);
        continue;
      }
    }
    if (opts_.unk_id >= 0) {
      if (unk_pending && !opts_.fuse_unk) add(opts_.unk_id);
      unk_pending = true;
    }
  }
  if (unk_pending) add(opts_.unk_id);
  if (sym.empty()) return;
  sym.back().next = -1;

  std::vector<Candidate>& heap = scratch.heap;
  heap.clear();
  for (size_t p = 0; p + 1 < sym.size(); ++p)
    if (const Merge* m = merges_.find(sym[p].id, sym[p + 1].id))
      heap.push_back(Candidate{m->rank, static_cast<int32_t>(p), m->new_id});
  std::make_heap(heap.begin(), heap.end(), lower_priority);
  const auto push = [&](Candidate c) {
    heap.push_back(c);
    std::push_heap(heap.begin(), heap.end(), lower_priority);
  };

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower_priority);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = sym[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(left.next)];
    const Merge* m = merges_.find(left.id, right.id);
    if (!m || m->new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0)
      if (const Merge* mp = merges_.find(sym[static_cast<size_t>(left.prev)].id, left.id))
        push(Candidate{mp->rank, left.prev, mp->new_id});
    if (left.next >= 0)
      if (const Merge* mn = merges_.find(left.id, sym[static_cast<size_t>(left.next)].id))
        push(Candidate{mn->rank, top.pos, mn->new_id});
  }
  for (const Symbol& s : sym)
    if (s.alive) out.push_back(s.id);
}

}  // namespace loom::tok
