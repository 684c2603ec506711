// BPE merging (see bpe.h). The heap discipline, the stale-entry check and the
// unknown/byte-fallback handling follow HF `tokenizers` step by step, because
// any deviation changes ids on some input.
#include "tokenizer/bpe.h"

#include <queue>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace loom::tok {

BpeModel::BpeModel(const std::vector<std::string>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& opts,
                   const std::string& what)
    : opts_(opts) {
  index_.reserve(vocab.size());
  for (size_t i = 0; i < vocab.size(); ++i)
    if (!vocab[i].empty()) index_[vocab[i]] = static_cast<int32_t>(i);
  for (int b = 0; b < 256; ++b) byte_ids_[b] = find(fmt::format("<0x{:02X}>", b));
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
      fail(ErrorKind::invalid_input, "{}: merges[{}]: the merged token {:?} is not in the vocabulary", what, r,
           joined);
    merges_[pair_key(ia, ib)] = Merge{static_cast<int32_t>(r), inew};
  }
}

int32_t BpeModel::find(std::string_view text) const {
  auto it = index_.find(text);
  return it == index_.end() ? -1 : it->second;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (opts_.ignore_merges) {
    if (const int32_t id = find(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // Initial symbols: one per character, a run of <0xXX> tokens for a character
  // not in the vocabulary (byte fallback), else the unknown token (fused if asked).
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
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
    if (const int32_t id = find(ch); id >= 0) {
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

  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator<(const Candidate& o) const {  // max-heap: lowest rank, then leftmost, on top
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  for (size_t p = 0; p + 1 < sym.size(); ++p)
    if (const Merge* m = find_merge(sym[p].id, sym[p + 1].id))
      queue.push(Candidate{m->rank, static_cast<int32_t>(p), m->new_id});

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = sym[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(left.next)];
    const Merge* m = find_merge(left.id, right.id);
    if (!m || m->new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0)
      if (const Merge* mp = find_merge(sym[static_cast<size_t>(left.prev)].id, left.id))
        queue.push(Candidate{mp->rank, left.prev, mp->new_id});
    if (left.next >= 0)
      if (const Merge* mn = find_merge(left.id, sym[static_cast<size_t>(left.next)].id))
        queue.push(Candidate{mn->rank, top.pos, mn->new_id});
  }
  for (const Symbol& s : sym)
    if (s.alive) out.push_back(s.id);
}

}  // namespace loom::tok
