// The lazily determinized grammar recognizer, the vocabulary trie and the per-choice token mask
// (grammar_matcher.h).
#include "serve/grammar_matcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace loom {

using Op = Grammar::Op;

// --- GrammarAutomaton ------------------------------------------------------------------------------------

GrammarAutomaton::GrammarAutomaton(std::shared_ptr<const Grammar> grammar, size_t start_work)
    : g_(std::move(grammar)), nc_(static_cast<size_t>(g_->n_classes())) {
  limit_work(start_work);
  clear();
}

void GrammarAutomaton::clear() {
  nodes_.assign(1, Node{-1, 0});  // node 0: the bottom
  node_ids_.clear();
  state_ids_.clear();
  state_begin_.assign({0, 0});  // state 0 (dead): no stack
  stack_ids_.clear();
  accepts_.assign(1, 0);
  trans_.assign(nc_, kDead);
  state_ids_.emplace(std::string(), kDead);
  std::vector<int32_t> stacks;
  for (const int32_t alt : g_->rule_alts[static_cast<size_t>(g_->root)]) expand(alt, 0, stacks);
  start_ = intern_state(stacks);
}

int32_t GrammarAutomaton::node(int32_t pos, int32_t parent) {
  const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent);
  const auto [it, added] = node_ids_.emplace(key, static_cast<int32_t>(nodes_.size()));
  if (added) nodes_.push_back({pos, parent});
  return it->second;
}

void GrammarAutomaton::expand(int32_t pos, int32_t parent, std::vector<int32_t>& out) {
  // A work list, not recursion: rule chains may be long. `seen_` stops repeated work where nullable rules
  // reach one position along several paths (left recursion, which would never stop, is refused earlier).
  work_.assign(1, {pos, parent});
  seen_.clear();
  while (!work_.empty()) {
    const auto [p, par] = work_.back();
    work_.pop_back();
    spend(1);
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(p)) << 32) | static_cast<uint32_t>(par);
    if (!seen_.insert(key).second) continue;
    const Grammar::Elem e = g_->elems[static_cast<size_t>(p)];
    if (e.op == Op::end) {
      if (par == 0) {
        out.push_back(0);  // the root is complete
      } else {
        const Node below = nodes_[static_cast<size_t>(par)];
        work_.emplace_back(below.pos, below.parent);
      }
    } else if (e.op == Op::bytes) {
      out.push_back(node(p, par));
    } else {
      // Tail call: a rule that ends its alternative returns straight to `par`, so repetitions
      // (R ::= x R) keep the stack's depth.
      const int32_t ret = g_->elems[static_cast<size_t>(p) + 1].op == Op::end ? par : node(p + 1, par);
      for (const int32_t alt : g_->rule_alts[static_cast<size_t>(e.arg)]) work_.emplace_back(alt, ret);
    }
  }
}

int32_t GrammarAutomaton::intern_state(std::vector<int32_t>& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  std::string key(stacks.size() * sizeof(int32_t), '\0');
  if (!stacks.empty()) std::memcpy(key.data(), stacks.data(), key.size());
  const auto [it, added] = state_ids_.emplace(std::move(key), static_cast<int32_t>(accepts_.size()));
  if (!added) return it->second;
  stack_ids_.insert(stack_ids_.end(), stacks.begin(), stacks.end());
  state_begin_.push_back(static_cast<uint32_t>(stack_ids_.size()));
  accepts_.push_back(!stacks.empty() && stacks.front() == 0 ? 1 : 0);
  trans_.resize(trans_.size() + nc_, -1);
  return it->second;
}

void GrammarAutomaton::spend(size_t steps) {
  if (steps > work_left_)
    throw GrammarError(
        fmt::format("the grammar is too ambiguous to enforce: more than {} parser steps for one token "
                    "(or before the first): too many of its alternatives stay open together (e.g. optional "
                    "delimiters around a recursive rule); make its alternatives exclusive",
                    work_limit_));
  work_left_ -= steps;
}

int32_t GrammarAutomaton::compute(int32_t state, size_t at, uint8_t byte) {
  std::vector<int32_t> out;
  const auto s = static_cast<size_t>(state);
  spend(state_begin_[s + 1] - state_begin_[s]);
  for (uint32_t k = state_begin_[s]; k < state_begin_[s + 1]; ++k) {
    const int32_t id = stack_ids_[k];
    if (id == 0) continue;
    const Node n = nodes_[static_cast<size_t>(id)];
    const Grammar::Elem e = g_->elems[static_cast<size_t>(n.pos)];
    if (Grammar::has(g_->bytesets[static_cast<size_t>(e.arg)], byte)) expand(n.pos + 1, n.parent, out);
  }
  const int32_t to = intern_state(out);
  trans_[at] = to;
  return to;
}

int32_t GrammarAutomaton::walk(int32_t state, std::string_view bytes) {
  for (const char c : bytes) {
    state = next(state, static_cast<uint8_t>(c));
    if (state == kDead) break;
  }
  return state;
}

bool GrammarAutomaton::can_continue(int32_t state) const {
  const auto s = static_cast<size_t>(state);
  for (uint32_t k = state_begin_[s]; k < state_begin_[s + 1]; ++k)
    if (stack_ids_[k] != 0) return true;
  return false;
}

int32_t GrammarAutomaton::reset_keeping(int32_t keep) {
  std::vector<std::vector<int32_t>> chains;  // positions from the top down
  const auto s = static_cast<size_t>(keep);
  for (uint32_t k = state_begin_[s]; k < state_begin_[s + 1]; ++k) {
    std::vector<int32_t> chain;
    for (int32_t id = stack_ids_[k]; id != 0; id = nodes_[static_cast<size_t>(id)].parent)
      chain.push_back(nodes_[static_cast<size_t>(id)].pos);
    chains.push_back(std::move(chain));
  }
  const bool dead = keep == kDead;
  clear();
  if (dead) return kDead;
  std::vector<int32_t> stacks;
  for (const auto& chain : chains) {
    int32_t id = 0;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) id = node(*it, id);
    stacks.push_back(id);
  }
  return intern_state(stacks);
}

bool grammar_matches(std::shared_ptr<const Grammar> grammar, std::string_view text) {
  GrammarAutomaton a(std::move(grammar));
  const int32_t s = a.walk(a.start(), text);
  return s != GrammarAutomaton::kDead && a.accepts(s);
}

// --- TokenTrie -------------------------------------------------------------------------------------------

TokenTrie::TokenTrie(const std::vector<std::string>& pieces, const std::vector<bool>& excluded)
    : pieces_(pieces), included_(pieces.size(), 0), vocab_(static_cast<int32_t>(pieces.size())) {
  std::vector<int32_t> order;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const bool skip = (i < excluded.size() && excluded[i]) || pieces[i].empty() || pieces[i].size() > 1024;
    if (skip) continue;
    included_[i] = 1;
    order.push_back(static_cast<int32_t>(i));
  }
  // Sorted pieces list every subtree contiguously: the order of a depth-first walk.
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return pieces[static_cast<size_t>(a)] < pieces[static_cast<size_t>(b)]; });
  std::vector<int32_t> path;  // node index per depth - 1
  const std::string* prev = nullptr;
  for (const int32_t id : order) {
    const std::string& p = pieces[static_cast<size_t>(id)];
    if (prev == nullptr || p != *prev) {
      size_t common = 0;
      if (prev != nullptr)
        while (common < p.size() && common < prev->size() && p[common] == (*prev)[common]) ++common;
      while (path.size() > common) {
        nodes_[static_cast<size_t>(path.back())].skip = static_cast<int32_t>(nodes_.size());
        path.pop_back();
      }
      for (size_t k = common; k < p.size(); ++k) {
        const auto at = static_cast<int32_t>(ids_.size());
        nodes_.push_back({static_cast<uint8_t>(p[k]), static_cast<uint16_t>(k + 1), 0, at, at});
        path.push_back(static_cast<int32_t>(nodes_.size() - 1));
      }
      max_depth_ = std::max(max_depth_, static_cast<int32_t>(p.size()));
    }
    ids_.push_back(id);
    nodes_[static_cast<size_t>(path.back())].tok_end = static_cast<int32_t>(ids_.size());
    prev = &p;
  }
  for (const int32_t n : path) nodes_[static_cast<size_t>(n)].skip = static_cast<int32_t>(nodes_.size());
}

// --- GrammarMatcher --------------------------------------------------------------------------------------

namespace {
// Past this many cached states (a few MB of transitions) or stack nodes (~15 MB with their index), the
// automaton starts again from the current state.
constexpr size_t kMaxStates = 1 << 15;
constexpr size_t kMaxNodes = 1 << 18;
constexpr size_t kMaxCachedMasks = 16;
}  // namespace

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar, const TokenTrie& vocab,
                               std::vector<int32_t> end_ids, size_t token_work)
    : auto_(std::move(grammar), token_work),
      vocab_(vocab),
      end_ids_(std::move(end_ids)),
      token_work_(token_work),
      state_(auto_.start()) {
  std::erase_if(end_ids_, [&](int32_t id) { return id < 0 || id >= vocab_.vocab_size(); });
  depth_state_.resize(static_cast<size_t>(vocab_.max_depth()) + 1);
}

bool GrammarMatcher::is_end(int32_t token) const {
  return std::find(end_ids_.begin(), end_ids_.end(), token) != end_ids_.end();
}

void GrammarMatcher::compute_mask(std::vector<uint64_t>& mask) {
  mask.assign((static_cast<size_t>(vocab_.vocab_size()) + 63) / 64, 0);
  const auto& nodes = vocab_.nodes();
  const auto& ids = vocab_.token_ids();
  depth_state_[0] = state_;
  const size_t n = nodes.size();
  for (size_t i = 0; i < n;) {
    const TokenTrie::Node& nd = nodes[i];
    const int32_t s = auto_.next(depth_state_[nd.depth - 1u], nd.byte);
    if (s == GrammarAutomaton::kDead) {
      i = static_cast<size_t>(nd.skip);  // no token with this prefix can follow
      continue;
    }
    depth_state_[nd.depth] = s;
    for (int32_t k = nd.tok_begin; k < nd.tok_end; ++k) {
      const auto id = static_cast<uint32_t>(ids[static_cast<size_t>(k)]);
      mask[id >> 6] |= uint64_t{1} << (id & 63);
    }
    ++i;
  }
  const bool done = auto_.accepts(state_);
  for (const int32_t id : end_ids_) {
    const auto u = static_cast<uint32_t>(id);
    if (done)
      mask[u >> 6] |= uint64_t{1} << (u & 63);
    else
      mask[u >> 6] &= ~(uint64_t{1} << (u & 63));
  }
}

const std::vector<uint64_t>& GrammarMatcher::allowed() {
  if (mask_state_ == state_) return mask_;
  auto_.limit_work(token_work_);
  if (auto_.n_states() > kMaxStates || auto_.n_nodes() > kMaxNodes) {
    state_ = auto_.reset_keeping(state_);
    mask_cache_.clear();
  }
  const auto it = mask_cache_.find(state_);
  if (it != mask_cache_.end()) {
    mask_ = it->second;
  } else {
    compute_mask(mask_);
    if (mask_cache_.size() >= kMaxCachedMasks) mask_cache_.clear();
    mask_cache_.emplace(state_, mask_);
  }
  mask_state_ = state_;
  return mask_;
}

bool GrammarMatcher::any_allowed() {
  const auto& m = allowed();
  return std::any_of(m.begin(), m.end(), [](uint64_t w) { return w != 0; });
}

const float* GrammarMatcher::masked_logits(const float* logits, int64_t n_logits) {
  const auto& m = allowed();
  masked_.resize(static_cast<size_t>(n_logits));
  const int64_t v = std::min<int64_t>(n_logits, vocab_.vocab_size());
  bool any = false;
  for (int64_t i = 0; i < v; ++i) {
    const bool ok = (m[static_cast<size_t>(i) >> 6] >> (i & 63)) & 1;
    masked_[static_cast<size_t>(i)] = ok ? logits[i] : -std::numeric_limits<float>::infinity();
    any |= ok;
  }
  for (int64_t i = v; i < n_logits; ++i) masked_[static_cast<size_t>(i)] = -std::numeric_limits<float>::infinity();
  return any ? masked_.data() : nullptr;
}

bool GrammarMatcher::accept(int32_t token) {
  if (is_end(token)) return complete();
  if (token < 0 || token >= vocab_.vocab_size() || !vocab_.included(token)) return false;
  auto_.limit_work(token_work_);
  const int32_t s = auto_.walk(state_, vocab_.piece(token));
  if (s == GrammarAutomaton::kDead) return false;
  state_ = s;
  return true;
}

}  // namespace loom
