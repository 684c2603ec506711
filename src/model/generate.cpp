#include "model/generate.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace loom {

std::string StopStreamer::push(const std::string& piece) {
  if (stopped_) return {};
  pending_ += piece;
  for (const auto& stop : stops_) {
    const size_t at = stop.empty() ? std::string::npos : pending_.find(stop);
    if (at != std::string::npos) {
      stopped_ = true;
      std::string out = pending_.substr(0, at);
      pending_.clear();
      return out;
    }
  }
  // Keep the longest suffix that is a prefix of some stop string.
  size_t hold = 0;
  for (const auto& stop : stops_)
    for (size_t k = std::min(stop.size() - (stop.empty() ? 0 : 1), pending_.size()); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, stop, 0, k) == 0) { hold = k; break; }
  size_t emit = pending_.size() - hold;
  emit = tok::utf8_complete_prefix(std::string_view(pending_).substr(0, emit));
  std::string out = pending_.substr(0, emit);
  pending_.erase(0, emit);
  return out;
}

std::string StopStreamer::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  pending_.clear();
  return out;
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::length: return "length";
    case FinishReason::stop: return "stop";
    case FinishReason::context_full: return "context_full";
  }
  return "?";
}

GenerateResult generate(InferenceSession& session, const Tokenizer& tok, std::span<const int32_t> prompt,
                        const GenerateOptions& opts, const std::function<bool(const std::string&)>& on_text) {
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  if (session.n_past() + r.prompt_tokens >= session.n_ctx())
    fail(ErrorKind::invalid_input, "the prompt is {} tokens, which leaves no room in the context of {} tokens{}",
         r.prompt_tokens, session.n_ctx(), session.n_past() ? " (with the conversation so far)" : "");
  // A model vocabulary padded past its tokenizer (Qwen2 has 151,936 rows for 151,665 tokens): the padded
  // ids stand for no text, so they are never sampled.
  Sampler sampler(opts.sampling, std::min<int64_t>(session.vocab_size(), tok.vocab_size()));
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  StopStreamer streamer(opts.stop);

  auto t0 = clock::now();
  const float* logits = session.eval(prompt);
  auto t1 = clock::now();
  r.prompt_seconds = std::chrono::duration<double>(t1 - t0).count();

  // Takes a sampled token: false when generation ends with it. Plain decoding
  // then holds every kept token but the last in the session (all of them after
  // an end-of-generation token, which is not kept).
  const int64_t prompt_end = session.n_past();
  bool ended_by_eog = false;
  auto take = [&](int32_t id) {
    if (tok.is_eog(id) || std::find(opts.extra_eos.begin(), opts.extra_eos.end(), id) != opts.extra_eos.end()) {
      r.finish = FinishReason::stop;
      ended_by_eog = true;
      return false;
    }
    r.tokens.push_back(id);
    history.push_back(id);
    const std::string text = streamer.push(tok.token_to_piece(id));
    if (!text.empty() && !on_text(text)) {
      r.finish = FinishReason::stop;
      return false;
    }
    if (streamer.stopped()) {
      r.finish = FinishReason::stop;
      return false;
    }
    const auto n = static_cast<int64_t>(r.tokens.size());
    if (opts.max_tokens >= 0 && n == opts.max_tokens) return false;
    if (prompt_end + n - 1 >= session.n_ctx()) {
      r.finish = FinishReason::context_full;
      return false;
    }
    return true;
  };

  const bool speculate = opts.spec.enabled();
  const auto V = static_cast<size_t>(session.vocab_size());
  std::vector<int32_t> drafts, chunk;
  int64_t draft_length = opts.spec.num_draft;  // adapted after each verification
  if (opts.max_tokens != 0) {
    int32_t id = sampler.sample(logits, history);
    while (take(id)) {
      ++r.forward_steps;
      if (speculate) {
        // Room for the drafts in the context and in max_tokens (the last kept token is never evaluated).
        int64_t room = session.n_ctx() - session.n_past() - 1;
        if (opts.max_tokens >= 0)
          room = std::min(room, opts.max_tokens - static_cast<int64_t>(r.tokens.size()) - 1);
        propose_ngram_drafts(history, opts.spec, std::min(room, draft_length), drafts);
      }
      if (drafts.empty()) {
        logits = session.eval(std::span<const int32_t>(&id, 1));
        id = sampler.sample(logits, history);
        continue;
      }
      // Verify: one evaluation of [id, drafts]; row j predicts the token after drafts[j - 1].
      chunk.assign(1, id);
      chunk.insert(chunk.end(), drafts.begin(), drafts.end());
      const int64_t base = session.n_past();
      session.eval(chunk, /*all_logits=*/true);
      const float* rows = session.logits().data();
      r.draft_tokens += static_cast<int64_t>(drafts.size());
      size_t j = 0;
      bool more = true;
      for (;; ++j) {
        id = sampler.sample(rows + j * V, history, j < drafts.size() ? drafts[j] : -1);
        if (j == drafts.size() || id != drafts[j]) break;
        ++r.accepted_tokens;
        if (!(more = take(id))) break;
      }
      if (!more) break;
      draft_length =
          next_draft_length(opts.spec, static_cast<int64_t>(j), static_cast<int64_t>(drafts.size()));
      session.truncate(base + 1 + static_cast<int64_t>(j));  // drop the rejected drafts' positions
    }
    // As plain decoding leaves it (speculation may have evaluated kept or rejected tokens beyond).
    const int64_t keep =
        prompt_end + static_cast<int64_t>(r.tokens.size()) - (ended_by_eog || r.tokens.empty() ? 0 : 1);
    if (session.n_past() > keep) session.truncate(keep);
  }
  const std::string rest = streamer.flush();
  if (!rest.empty()) on_text(rest);
  r.generate_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace loom
