// Token-by-token enforcement of a Grammar (grammar.h).
//
// GrammarAutomaton recognizes bytes with a set of pushdown stacks (llama.cpp's representation: each stack a
// chain of return positions, the top a byte-set element), determinized lazily: a set of stacks is interned
// as a state and each (state, byte class) transition is computed once and cached. Inside a JSON string or a
// run of digits the state recurs, so after a few tokens most transitions are table lookups.
//
// TokenTrie holds the vocabulary's byte strings in depth-first order; the mask of a step is one walk of it
// that skips a whole subtree as soon as its prefix is dead (outlines' / XGrammar's idea of sharing the work
// of common prefixes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "serve/grammar.h"

namespace loom {

class GrammarAutomaton {
 public:
  static constexpr int32_t kDead = 0;  // no stack left: the bytes so far are no prefix of the grammar

  // `start_work`: the bound (limit_work) on expanding the start state, whose open parses can already be
  // exponentially many (`a0 ::= a1 "x" | a1 "y"`, `a1 ::= a2 "x" | a2 "y"`, ...: 2^n before any byte).
  explicit GrammarAutomaton(std::shared_ptr<const Grammar> grammar, size_t start_work = SIZE_MAX);

  int32_t start() const { return start_; }
  int32_t next(int32_t state, uint8_t byte) {
    const size_t at = static_cast<size_t>(state) * nc_ + g_->byte_class[byte];
    const int32_t to = trans_[at];
    return to >= 0 ? to : compute(state, at, byte);
  }
  int32_t walk(int32_t state, std::string_view bytes);
  // The bytes read so far are a whole sentence of the grammar.
  bool accepts(int32_t state) const { return accepts_[static_cast<size_t>(state)] != 0; }
  // Some byte can follow.
  bool can_continue(int32_t state) const;
  size_t n_states() const { return accepts_.size(); }
  // Drops every cached state but `keep`, whose new id is returned (bounds memory over long generations).
  int32_t reset_keeping(int32_t keep);
  size_t n_nodes() const { return nodes_.size(); }
  // Bounds the work of the transitions computed from here on (stacks read, expansion steps): past
  // `steps`, next() throws GrammarError. An ambiguous grammar can keep exponentially many stacks open
  // (optional delimiters around a recursive rule: a fuzzed grammar reached 71,000 in one state), and the
  // token mask computes a transition per trie node; without a bound one request would hold the scheduler
  // for minutes. Unbounded until called.
  void limit_work(size_t steps) { work_limit_ = work_left_ = steps; }
  const Grammar& grammar() const { return *g_; }

 private:
  struct Node {
    int32_t pos;     // top of the stack: a bytes element; below it: the position to continue at
    int32_t parent;  // node below; 0: the bottom (the root rule returns there)
  };
  int32_t compute(int32_t state, size_t at, uint8_t byte);
  void spend(size_t steps);
  int32_t node(int32_t pos, int32_t parent);
  // Adds to `out` the stacks whose tops are bytes elements, reached from "continue at pos, then parent".
  void expand(int32_t pos, int32_t parent, std::vector<int32_t>& out);
  int32_t intern_state(std::vector<int32_t>& stacks);
  void clear();

  std::shared_ptr<const Grammar> g_;
  size_t nc_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, int32_t> node_ids_;
  std::vector<uint32_t> state_begin_;  // stacks of state s: stack_ids_[state_begin_[s] .. state_begin_[s+1])
  std::vector<int32_t> stack_ids_;
  std::unordered_map<std::string, int32_t> state_ids_;
  std::vector<uint8_t> accepts_;
  std::vector<int32_t> trans_;  // state * n_classes + class -> state; -1: not computed yet
  int32_t start_ = 0;
  std::vector<std::pair<int32_t, int32_t>> work_;  // expand's scratch
  std::unordered_set<uint64_t> seen_;
  size_t work_limit_ = SIZE_MAX, work_left_ = SIZE_MAX;
};

// True when `text` is a whole sentence of the grammar (tests, reference masks).
bool grammar_matches(std::shared_ptr<const Grammar> grammar, std::string_view text);

class TokenTrie {
 public:
  // pieces[id]: the bytes token id stands for. Tokens with `excluded[id]` (special tokens, which never
  // spell grammar text) or an empty piece are left out.
  TokenTrie(const std::vector<std::string>& pieces, const std::vector<bool>& excluded);

  struct Node {
    uint8_t byte;
    uint16_t depth;     // 1 for a token's first byte
    int32_t skip;       // the index after this node's subtree
    int32_t tok_begin;  // tokens ending here: token_ids()[tok_begin .. tok_end)
    int32_t tok_end;
  };
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<int32_t>& token_ids() const { return ids_; }
  int32_t vocab_size() const { return vocab_; }
  int32_t max_depth() const { return max_depth_; }
  const std::string& piece(int32_t id) const { return pieces_[static_cast<size_t>(id)]; }
  bool included(int32_t id) const { return included_[static_cast<size_t>(id)] != 0; }

 private:
  std::vector<Node> nodes_;
  std::vector<int32_t> ids_;
  std::vector<std::string> pieces_;
  std::vector<uint8_t> included_;
  int32_t vocab_ = 0;
  int32_t max_depth_ = 0;
};

// One constrained choice: the grammar state after the tokens generated so far and the mask of the next.
class GrammarMatcher {
 public:
  // The parser steps (GrammarAutomaton::limit_work) one token's mask, and its acceptance, may take by
  // default: 8x the most measured on real grammars over SmolLM2's 49,152 tokens (random 200-token walks:
  // a 1,000-string guided_choice within 2^15, JSON schemas 2^14, llama.cpp's example grammars 2^10-2^11);
  // reaching it costs ~0.1 s and ~25 MB.
  static constexpr size_t kTokenWork = size_t{1} << 18;

  // `end_ids`: the tokens that end generation; allowed exactly where the grammar is complete. Past
  // `token_work` parser steps for one token (or for the start state), allowed() / masked_logits() /
  // accept() (or the constructor) throw GrammarError.
  GrammarMatcher(std::shared_ptr<const Grammar> grammar, const TokenTrie& vocab, std::vector<int32_t> end_ids,
                 size_t token_work = kTokenWork);

  // Bit i of word i/64: token i may come next. Recomputed when the state changed.
  const std::vector<uint64_t>& allowed();
  bool any_allowed();
  // `logits` (n_logits of them; ids past the vocabulary are never allowed) with the disallowed tokens at -inf, in a buffer of this matcher; null when
  // no token is allowed.
  const float* masked_logits(const float* logits, int64_t n_logits);
  // Advances over a sampled token; false (state unchanged) when the grammar does not allow it.
  bool accept(int32_t token);
  bool complete() const { return auto_.accepts(state_); }
  bool is_end(int32_t token) const;
  // One walk of the vocabulary trie from the current state, bypassing the mask cache (allowed() uses it;
  // public for the benchmark).
  void compute_mask(std::vector<uint64_t>& mask);

 private:

  GrammarAutomaton auto_;
  const TokenTrie& vocab_;
  std::vector<int32_t> end_ids_;
  size_t token_work_;
  int32_t state_;
  int32_t mask_state_ = -1;  // the state `mask_` was computed for
  std::vector<uint64_t> mask_;
  // Masks of recent states: generation often returns to one (the inside of a string).
  std::unordered_map<int32_t, std::vector<uint64_t>> mask_cache_;
  std::vector<int32_t> depth_state_;
  std::vector<float> masked_;
};

}  // namespace loom
