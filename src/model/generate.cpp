#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters
#include "tokenizer/tokenizer.h"

namespace loom {

size_t utf8_complete_prefix(const std::string& s) {
  size_t n = s.size();
  // Walk back over at most 3 continuation bytes to the last lead byte.
  size_t i = n;
  int cont = 0;
  while (i > 0 && cont < 4) {
    const auto c = static_cast<unsigned char>(s[i - 1]);
    if ((c & 0xC0) != 0x80) {
      const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      return (n - (i - 1) >= need) ? n : i - 1;
    }
    --i;
    ++cont;
  }
  return n;  // not valid UTF-8 anyway: emit as is
}

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
  emit = utf8_complete_prefix(pending_.substr(0, emit));
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
  Sampler sampler(opts.sampling, session.vocab_size());
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  StopStreamer streamer(opts.stop);

  auto t0 = clock::now();
  const float* logits = session.eval(prompt);
  auto t1 = clock::now();
  r.prompt_seconds = std::chrono::duration<double>(t1 - t0).count();

  for (int64_t i = 0; opts.max_tokens < 0 || i < opts.max_tokens; ++i) {
    const int32_t id = sampler.sample(logits, history);
    if (tok.is_eog(id) || std::find(opts.extra_eos.begin(), opts.extra_eos.end(), id) != opts.extra_eos.end()) {
      r.finish = FinishReason::stop;
      break;
    }
    r.tokens.push_back(id);
    history.push_back(id);
    const std::string text = streamer.push(tok.token_to_piece(id));
    if (!text.empty() && !on_text(text)) { r.finish = FinishReason::stop; break; }
    if (streamer.stopped()) { r.finish = FinishReason::stop; break; }
    if (opts.max_tokens >= 0 && i + 1 == opts.max_tokens) break;
    if (session.n_past() >= session.n_ctx()) { r.finish = FinishReason::context_full; break; }
    logits = session.eval(std::span<const int32_t>(&id, 1));
  }
  const std::string rest = streamer.flush();
  if (!rest.empty()) on_text(rest);
  r.generate_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace loom
