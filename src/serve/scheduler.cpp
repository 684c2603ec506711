// Continuous batching over the paged KV cache (scheduler.h).
//
// Each step: cancelled requests are dropped; waiting sequences are admitted
// while there are sequence slots and KV blocks for their whole prompt (reusing
// cached prefix blocks); every running sequence in decode contributes one row
// (a sequence that cannot get a block preempts the newest running sequence,
// which is recomputed later, never failed); prefills fill the rest of the token
// budget in chunks; one BatchForward step runs all rows; sequences whose last
// token was computed sample the next one and stream it.
#include "serve/scheduler.h"

#include "model/tensor_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <random>
#include <stdexcept>

#include "kernels/profiling_backend.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace loom {

struct ServingEngine::Sequence {
  Request* req = nullptr;
  int32_t choice = 0;               // 0 .. n-1 within the request
  std::vector<int32_t> tokens;      // prompt, then generated tokens
  std::vector<int32_t> generated;
  int64_t n_computed = 0;           // positions whose K/V are in the cache
  BlockTable table;
  Sampler sampler;
  StreamDecoder decoder;
  StopStreamer stop;
  bool finished = false;

  Sequence(Request* r, int32_t c, const SamplingParams& sp, int64_t vocab, const Tokenizer& tok,
           std::vector<std::string> stops)
      : req(r), choice(c), sampler(sp, vocab), decoder(tok), stop(std::move(stops)) {}
};

struct ServingEngine::Request {
  GenerationRequest g;
  std::shared_ptr<RequestStream> stream;
  std::vector<int32_t> prompt;
  int64_t max_new = 0;
  bool wants_adapter = false;
  std::shared_ptr<const LoadedAdapter> adapter;  // acquired when first admitted
  std::vector<std::unique_ptr<Sequence>> seqs;
  int64_t open = 0;  // unfinished choices
  Usage usage;
  bool ended = false;  // done or error sent
};

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// The device's backend, wrapped to record ops when the server has a tracer.
std::unique_ptr<Backend> make_serve_backend(const ServeOptions& o, ThreadPool& pool) {
  std::unique_ptr<Backend> b = make_backend(o.device, pool);
  if (o.tracer) b = make_profiling_backend(std::move(b), *o.tracer, pool);
  return b;
}

// The model, or with ServeOptions::tp this rank's shard of it.
std::unique_ptr<Model> load_serve_model(const ServeOptions& o, Backend& backend) {
  Model::LoadOptions lo{.tokenizer = true, .pack = true, .backend = &backend};
  const int ranks = o.tp != nullptr ? o.tp->size() : 1;
  if (ranks > 1)
    lo.before_pack = [&](ModelWeights& w, const ModelConfig& c) {
      shard_weights_for_tensor_parallel(w, c, o.tp->rank(), ranks);
    };
  std::unique_ptr<Model> m = Model::load(o.model_path, lo);
  if (ranks > 1) m->reshape(tensor_parallel_config(m->config(), ranks));
  return m;
}

}  // namespace

ServingEngine::ServingEngine(ServeOptions options)
    : opt_(std::move(options)),
      pool_(opt_.threads > 0 ? opt_.threads : default_thread_count()),
      backend_(make_serve_backend(opt_, pool_)),
      model_(load_serve_model(opt_, *backend_)),
      adapters_(model_->config(), opt_.adapter_dirs, opt_.max_loras, opt_.lora_bits, opt_.max_lora_memory) {
  const ModelConfig& c = model_->config();
  name_ = opt_.model_name;
  if (name_.empty()) name_ = std::filesystem::path(opt_.model_path).filename().string();
  if (name_.empty()) name_ = std::filesystem::path(opt_.model_path).parent_path().filename().string();
  created_ = unix_now();
  const int64_t model_max = c.max_context > 0 ? c.max_context : 4096;
  if (opt_.max_model_len < 0) fail(ErrorKind::invalid_input, "--max-model-len must be >= 0");
  if (opt_.max_model_len > model_max)
    fail(ErrorKind::invalid_input, "--max-model-len {} exceeds the model's context length {}", opt_.max_model_len,
         model_max);
  max_len_ = opt_.max_model_len > 0 ? opt_.max_model_len : std::min<int64_t>(model_max, 4096);
  if (opt_.max_seqs < 1) fail(ErrorKind::invalid_input, "--max-seqs must be >= 1");
  if (opt_.block_size < 1 || opt_.block_size > 1024) fail(ErrorKind::invalid_input, "block size must be in [1, 1024]");
  opt_.max_batch_tokens = std::max(opt_.max_batch_tokens, opt_.max_seqs);

  const Tokenizer& tok = model_->tokenizer();
  eos_ids_ = model_->extra_eos_ids();
  // A bad --chat-template name is an error; an unrecognised model template is not (chat requests get one).
  try {
    if (auto t = resolve_chat_template(tok, opt_.chat_template, model_->chat_template_text()))
      template_ = std::make_unique<ChatTemplate>(std::move(*t));
  } catch (const Error&) {
    if (!opt_.chat_template.empty()) throw;
  }

  const size_t per_block = KvPool::bytes_per_block(c, opt_.block_size, opt_.kv_dtype);
  size_t budget = opt_.kv_cache_memory;
  if (budget == 0)
    budget = std::min<size_t>(size_t{2} << 30, per_block * static_cast<size_t>((max_len_ + opt_.block_size - 1) /
                                                                               opt_.block_size * opt_.max_seqs));
  const int64_t n_blocks = KvPool::blocks_for_bytes(c, budget, opt_.block_size, opt_.kv_dtype);
  const int64_t min_blocks = (max_len_ + opt_.block_size - 1) / opt_.block_size;
  if (n_blocks < min_blocks)
    fail(ErrorKind::invalid_input,
         "--kv-cache-memory {} holds {} blocks of {} tokens, fewer than one sequence of --max-model-len {} needs "
         "({} blocks, {} bytes)",
         budget, n_blocks, opt_.block_size, max_len_, min_blocks, static_cast<size_t>(min_blocks) * per_block);
  kv_ = std::make_unique<KvPool>(*backend_, c, n_blocks, opt_.block_size, opt_.kv_dtype);
  forward_ = std::make_unique<BatchForward>(c, model_->weights(), *backend_, *kv_, opt_.max_batch_tokens,
                                            std::min<int64_t>(opt_.max_seqs, 64));
  forward_->set_tensor_parallel(opt_.tp);
  if (tensor_parallel() && !opt_.adapters.empty())
    fail(ErrorKind::unsupported, "--adapter with --tp: adapters of a tensor-parallel server are not built yet");
  for (const auto& [name, dir] : opt_.adapters) {
    if (name == name_) fail(ErrorKind::invalid_input, "--adapter {}: the name is the base model's", name);
    adapters_.add(name, dir, /*runtime=*/false);
  }
  if (tensor_parallel() && opt_.tp->rank() != 0)
    thread_ = std::thread([this] { forward_->follow(); });
  else
    thread_ = std::thread([this] { loop(); });
}

ServingEngine::~ServingEngine() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  abort_.store(true);
  cv_.notify_all();
  // Whatever still runs is aborted; the loop ends once it has sent their final events.
  if (thread_.joinable() && !(tensor_parallel() && opt_.tp->rank() != 0)) thread_.join();
  if (tensor_parallel()) {
    if (opt_.tp->rank() == 0) forward_->stop_followers();  // their follow() returns
    if (thread_.joinable()) thread_.join();
  }
}

void ServingEngine::follow_until_stopped() {
  LOOM_ASSERT(tensor_parallel() && opt_.tp->rank() != 0);
  if (thread_.joinable()) thread_.join();
}

void ServingEngine::shutdown() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------
// HTTP-thread side

std::vector<int32_t> ServingEngine::render_prompt(const GenerationRequest& r) const {
  const Tokenizer& tok = model_->tokenizer();
  if (r.kind == RequestKind::chat) {
    if (!template_)
      throw EngineError(EngineErrc::invalid_request,
                        "the model has no chat template that loom recognises; use /v1/completions", "messages");
    const std::string text = apply_chat_template(*template_, r.messages, r.add_generation_prompt);
    return tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
  }
  if (r.prompt.is_tokens) {
    for (int32_t id : r.prompt.tokens)
      if (id < 0 || id >= model_->config().vocab_size)
        throw EngineError(EngineErrc::invalid_request,
                          fmt::format("token id {} is outside the vocabulary [0, {})", id, model_->config().vocab_size),
                          "prompt");
    return r.prompt.tokens;
  }
  return tok.encode(r.prompt.text, /*add_special=*/true, /*parse_special=*/true);
}

void ServingEngine::submit(GenerationRequest g, std::shared_ptr<RequestStream> stream) {
  auto r = std::make_unique<Request>();
  const bool is_base = g.model == name_;
  if (!is_base && !adapters_.contains(g.model))
    throw EngineError(EngineErrc::model_not_found, "the model '" + g.model + "' does not exist", "model");
  r->wants_adapter = !is_base;
  if (r->wants_adapter) {
    // Bind the adapter now: unloading it later never changes an accepted request.
    // (When every resident slot is busy it is bound at admission instead.)
    const auto a = adapters_.acquire(g.model);
    if (!a) throw EngineError(EngineErrc::model_not_found, "the model '" + g.model + "' does not exist", "model");
    r->adapter = *a;
  }
  try {
    validate_sampling(g.sampling);
  } catch (const Error& e) {
    throw EngineError(EngineErrc::invalid_request, e.what());
  }
  r->prompt = render_prompt(g);
  const char* prompt_param = g.kind == RequestKind::chat ? "messages" : "prompt";
  const auto n_prompt = static_cast<int64_t>(r->prompt.size());
  if (n_prompt == 0) throw EngineError(EngineErrc::invalid_request, "the prompt is empty", prompt_param);
  if (n_prompt >= max_len_)
    throw EngineError(EngineErrc::context_length_exceeded,
                      fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} "
                                  "tokens, leaving no room to generate.",
                                  max_len_, n_prompt),
                      prompt_param);
  r->max_new = g.max_tokens < 0 ? max_len_ - n_prompt : g.max_tokens;
  if (n_prompt + r->max_new > max_len_)
    throw EngineError(EngineErrc::context_length_exceeded,
                      fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                  "tokens ({} in the {}, {} for the completion).",
                                  max_len_, n_prompt + r->max_new, n_prompt, prompt_param, r->max_new),
                      "max_tokens");
  if (g.n < 1) throw EngineError(EngineErrc::invalid_request, "n must be at least 1", "n");
  r->usage.prompt_tokens = n_prompt;
  const uint64_t base_seed = g.seed ? *g.seed : fresh_seed();
  const Tokenizer& tok = model_->tokenizer();
  for (int32_t i = 0; i < g.n; ++i) {
    SamplingParams sp = g.sampling;
    sp.seed = base_seed + static_cast<uint64_t>(i);
    auto s = std::make_unique<Sequence>(r.get(), i, sp, model_->config().vocab_size, tok, g.stop);
    s->tokens = r->prompt;
    r->seqs.push_back(std::move(s));
  }
  r->open = g.n;
  r->g = std::move(g);
  r->stream = std::move(stream);
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw EngineError(EngineErrc::shutting_down, "the server is shutting down");
    if (incoming_.size() + static_cast<size_t>(n_waiting_.load()) >= opt_.max_waiting)
      throw EngineError(EngineErrc::overloaded, "too many requests are waiting; retry later");
    incoming_.push_back(std::move(r));
  }
  cv_.notify_one();
}

std::vector<ModelInfo> ServingEngine::list_models() {
  std::vector<ModelInfo> out;
  out.push_back({name_, "", opt_.model_path, created_});
  for (const AdapterInfo& a : adapters_.list()) out.push_back({a.name, name_, a.path, a.created});
  return out;
}

void ServingEngine::load_adapter(const std::string& name, const std::string& path) {
  if (tensor_parallel())
    throw EngineError(EngineErrc::adapter_load_failed, "adapters of a tensor-parallel server (--tp) are not built yet",
                      "lora_name");
  if (name == name_)
    throw EngineError(EngineErrc::adapter_exists, "'" + name + "' is the base model's name", "lora_name");
  adapters_.add(name, path, /*runtime=*/true);
}

void ServingEngine::unload_adapter(const std::string& name) { adapters_.remove(name); }

std::vector<int32_t> ServingEngine::tokenize(const TokenizeRequest& req) {
  if (!req.model.empty() && req.model != name_ && !adapters_.contains(req.model))
    throw EngineError(EngineErrc::model_not_found, "the model '" + req.model + "' does not exist", "model");
  const Tokenizer& tok = model_->tokenizer();
  if (req.is_chat) {
    if (!template_)
      throw EngineError(EngineErrc::invalid_request, "the model has no chat template that loom recognises",
                        "messages");
    return tok.encode(apply_chat_template(*template_, req.messages, req.add_generation_prompt), false, true);
  }
  return tok.encode(req.prompt, req.add_special_tokens, /*parse_special=*/true);
}

std::string ServingEngine::detokenize(const std::string& model, const std::vector<int32_t>& tokens) {
  if (!model.empty() && model != name_ && !adapters_.contains(model))
    throw EngineError(EngineErrc::model_not_found, "the model '" + model + "' does not exist", "model");
  for (int32_t id : tokens)
    if (id < 0 || id >= model_->config().vocab_size)
      throw EngineError(EngineErrc::invalid_request,
                        fmt::format("token id {} is outside the vocabulary [0, {})", id, model_->config().vocab_size),
                        "tokens");
  return model_->tokenizer().decode(tokens, /*skip_special=*/false);
}

EngineHealth ServingEngine::health() {
  std::lock_guard lock(mu_);
  if (stopping_) return {false, "shutting down"};
  return {};
}

EngineStats ServingEngine::stats() {
  EngineStats s;
  s.requests_running = n_running_.load();
  {
    std::lock_guard lock(mu_);
    s.requests_waiting = n_waiting_.load() + static_cast<int64_t>(incoming_.size());
  }
  s.kv_cache_usage = kv_usage_.load();
  s.adapters_loaded = adapters_.resident_count();
  return s;
}

// ---------------------------------------------------------------------------
// Scheduler thread

void ServingEngine::loop() {
  for (;;) {
    {
      std::unique_lock lock(mu_);
      while (!incoming_.empty()) {
        Request* r = incoming_.front().get();
        requests_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
        for (auto& s : r->seqs) waiting_.push_back(s.get());
      }
      if (stopping_ && requests_.empty()) break;
    }
    bool worked = true;
    try {
      worked = step();
    } catch (const std::exception& e) {
      // A failure outside any one request's rows (admission, the KV pool, ...): end every request with an
      // error rather than the process; the requests that come next are served as usual.
      recover(e);
    } catch (...) {
      recover(std::runtime_error("unknown exception"));
    }
    if (!worked) {
      std::unique_lock lock(mu_);
      // Wake for new work; poll a few times a second for cancelled waits.
      cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return !incoming_.empty() || stopping_; });
    }
  }
  publish_stats();
}

void ServingEngine::retire(Sequence* s) {
  if (s->finished) return;
  s->finished = true;
  kv_->release(s->table);
  --s->req->open;
}

void ServingEngine::cancel_requests() {
  // While stopping, requests may finish; the HTTP layer cancels their streams
  // when its grace period ends (or the destructor aborts everything).
  const bool abort_all = abort_.load();
  for (auto& r : requests_) {
    if (r->ended || !(abort_all || r->stream->cancelled())) continue;
    for (auto& s : r->seqs) retire(s.get());
  }
}

void ServingEngine::preempt(Sequence* s) {
  // Recompute later: drop the blocks (full ones stay in the prefix cache and
  // are likely matched again on readmission), keep tokens and sampler state.
  kv_->release(s->table);
  s->n_computed = 0;
  preemptions_.fetch_add(1);
  running_.erase(std::find(running_.begin(), running_.end(), s));
  waiting_.push_front(s);
}

void ServingEngine::admit() {
  const int64_t watermark = std::max<int64_t>(1, kv_->n_blocks() / 100);
  // A request whose adapter has no room yet waits; the ones behind it that
  // already hold their adapter (or use none) go ahead, since waiting requests
  // holding resident adapters could otherwise keep that room taken forever.
  // Requests behind it that still need room wait too (first come, first loaded).
  bool adapter_blocked = false;
  for (auto it = waiting_.begin(); it != waiting_.end() && static_cast<int64_t>(running_.size()) < opt_.max_seqs;) {
    Sequence* s = *it;
    Request* r = s->req;
    if (s->finished) {
      it = waiting_.erase(it);
      continue;
    }
    // Choices after the first wait for its prompt so that they share its cached blocks.
    if (s->choice > 0) {
      const Sequence* first = r->seqs[0].get();
      if (!first->finished && first->n_computed < static_cast<int64_t>(r->prompt.size())) {
        ++it;
        continue;
      }
    }
    if (r->wants_adapter && !r->adapter && adapter_blocked) {
      ++it;
      continue;
    }
    if (r->wants_adapter && !r->adapter) {
      std::optional<std::shared_ptr<const LoadedAdapter>> a;
      try {
        a = adapters_.acquire(r->g.model);
      } catch (const EngineError& e) {
        r->stream->push(GenerationEvent::make_error(e));
        r->ended = true;
        for (auto& q : r->seqs) retire(q.get());
        it = waiting_.erase(it);
        continue;
      }
      if (!a) {  // unloaded between submit and admission
        r->stream->push(GenerationEvent::make_error(
            EngineError(EngineErrc::model_not_found, "the adapter '" + r->g.model + "' was unloaded", "model")));
        r->ended = true;
        for (auto& q : r->seqs) retire(q.get());
        it = waiting_.erase(it);
        continue;
      }
      if (!*a) {  // no room beside the adapters in use: wait
        adapter_blocked = true;
        ++it;
        continue;
      }
      r->adapter = *a;
    }
    if (opt_.fault_hook) opt_.fault_hook(FaultPoint::admit, r->g);
    s->table.adapter_id = r->adapter ? r->adapter->id : 0;
    const auto n = static_cast<int64_t>(s->tokens.size());
    const int64_t cached = kv_->match_prefix(s->table, std::span<const int32_t>(s->tokens.data(), n - 1));
    // The whole known sequence is backed at admission, plus a free margin so
    // that running decodes rarely need to preempt.
    if (kv_->free_blocks() - kv_->blocks_needed(s->table, n) < watermark || !kv_->reserve(s->table, n)) {
      kv_->release(s->table);
      break;
    }
    s->n_computed = cached;
    running_.push_back(s);
    it = waiting_.erase(it);
  }
}

void ServingEngine::sample_and_emit(Sequence* s, const float* logits) {
  Request* r = s->req;
  const Tokenizer& tok = model_->tokenizer();
  const int64_t V = model_->config().vocab_size;
  const int32_t id = s->sampler.sample(logits, s->generated);
  ChoiceDelta d;
  d.index = r->g.first_choice_index + s->choice;
  d.token_ids.push_back(id);
  if (r->g.logprobs) {
    // Log-probabilities of the model's distribution (raw logits, before sampling filters).
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; ++i) mx = std::max(mx, logits[i]);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
    const double lse = mx + std::log(sum);
    TokenLogprob lp;
    lp.token_id = id;
    lp.token = tok.token_to_piece(id);
    lp.logprob = static_cast<float>(logits[id] - lse);
    const int64_t k = std::min<int64_t>(r->g.top_logprobs, V);
    if (k > 0) {
      std::vector<int32_t> idx(static_cast<size_t>(V));
      for (int64_t i = 0; i < V; ++i) idx[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      for (int64_t i = 0; i < k; ++i) {
        const int32_t t = idx[static_cast<size_t>(i)];
        lp.top.push_back({t, tok.token_to_piece(t), static_cast<float>(logits[t] - lse)});
      }
    }
    d.logprobs.push_back(std::move(lp));
  }
  s->tokens.push_back(id);
  s->generated.push_back(id);
  ++r->usage.completion_tokens;

  const bool eog = (!r->g.ignore_eos && (tok.is_eog(id) || std::find(eos_ids_.begin(), eos_ids_.end(), id) !=
                                                                eos_ids_.end())) ||
                   std::find(r->g.stop_token_ids.begin(), r->g.stop_token_ids.end(), id) != r->g.stop_token_ids.end();
  if (eog) {
    // The end-of-generation token is not part of the text.
    d.text = s->stop.push(s->decoder.finish());
    if (!s->stop.stopped()) d.text += s->stop.flush();
    d.finish = FinishKind::stop;
  } else {
    d.text = s->stop.push(s->decoder.push(id));
    if (s->stop.stopped()) {
      d.finish = FinishKind::stop;
    } else if (static_cast<int64_t>(s->generated.size()) >= r->max_new ||
               static_cast<int64_t>(s->tokens.size()) >= max_len_) {
      d.text += s->stop.push(s->decoder.finish());
      if (!s->stop.stopped()) d.text += s->stop.flush();
      d.finish = s->stop.stopped() ? FinishKind::stop : FinishKind::length;
    }
  }
  const bool done = d.finish.has_value();
  r->stream->push(GenerationEvent::make_delta(std::move(d)));
  if (done) retire(s);
}

void ServingEngine::build_batch(std::vector<BatchChunk>& chunks, std::vector<Sequence*>& owners) {
  // Decode rows first (one per sequence whose only missing position is its
  // last token); a sequence that cannot get a block preempts the newest.
  for (size_t i = 0; i < running_.size();) {
    Sequence* s = running_[i];
    const auto n = static_cast<int64_t>(s->tokens.size());
    if (s->finished || n - s->n_computed != 1) {
      ++i;
      continue;
    }
    if (kv_->reserve(s->table, n)) {
      ++i;
      continue;
    }
    // Out of blocks: preempt the newest running sequence (possibly s itself).
    Sequence* victim = running_.back();
    preempt(victim);
    if (victim == s) continue;  // s left running_; index i now holds the next one
  }
  int64_t budget = opt_.max_batch_tokens;
  for (Sequence* s : running_) {
    const auto n = static_cast<int64_t>(s->tokens.size());
    if (s->finished || n - s->n_computed != 1) continue;
    BatchChunk c;
    c.table = &s->table;
    c.n_past = s->n_computed;
    c.tokens = std::span<const int32_t>(s->tokens.data() + s->n_computed, 1);
    c.adapter = s->req->adapter ? &s->req->adapter->view : nullptr;
    c.want_logits = true;
    chunks.push_back(c);
    owners.push_back(s);
    --budget;
  }
  // Prefill chunks, oldest first, in what is left of the budget.
  for (Sequence* s : running_) {
    if (budget <= 0) break;
    const auto n = static_cast<int64_t>(s->tokens.size());
    if (s->finished || n - s->n_computed <= 1) continue;
    const int64_t len = std::min(budget, n - s->n_computed);
    BatchChunk c;
    c.table = &s->table;
    c.n_past = s->n_computed;
    c.tokens = std::span<const int32_t>(s->tokens.data() + s->n_computed, static_cast<size_t>(len));
    c.adapter = s->req->adapter ? &s->req->adapter->view : nullptr;
    c.want_logits = s->n_computed + len == n;
    chunks.push_back(c);
    owners.push_back(s);
    budget -= len;
  }
}

void ServingEngine::fail_request(Request* r, const std::exception& e) {
  if (r->ended) return;
  r->ended = true;
  for (auto& s : r->seqs) retire(s.get());
  publish_stats();  // before the client can see the error
  const auto* engine_error = dynamic_cast<const EngineError*>(&e);
  r->stream->push(GenerationEvent::make_error(
      engine_error ? *engine_error
                   : EngineError(EngineErrc::internal, fmt::format("generation failed: {}", e.what()))));
}

void ServingEngine::recover(const std::exception& e) {
  for (auto& r : requests_) fail_request(r.get(), e);
  running_.clear();
  waiting_.clear();
  requests_.clear();
  publish_stats();
}

void ServingEngine::forward_and_sample(const std::vector<BatchChunk>& chunks, const std::vector<Sequence*>& owners) {
  if (opt_.fault_hook) {
    std::vector<const Request*> seen;
    for (const Sequence* s : owners)
      if (std::find(seen.begin(), seen.end(), s->req) == seen.end()) {
        seen.push_back(s->req);
        opt_.fault_hook(FaultPoint::forward, s->req->g);
      }
  }
  {
    const TraceScope trace(backend_->tracer(), "forward");
    forward_->step(chunks);
  }
  const TraceScope trace(backend_->tracer(), "sample");  // sampling, detokenizing, streaming
  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence* s = owners[i];
    if (s->finished) continue;  // its request failed at an earlier row of this step
    s->n_computed += static_cast<int64_t>(chunks[i].tokens.size());
    kv_->commit_full_blocks(s->table, s->tokens, s->n_computed);
    if (!chunks[i].want_logits) continue;
    try {
      if (opt_.fault_hook) opt_.fault_hook(FaultPoint::sample, s->req->g);
      sample_and_emit(s, forward_->logits(i));
    } catch (const std::exception& e) {
      fail_request(s->req, e);
    }
  }
}

void ServingEngine::run_batch(const std::vector<BatchChunk>& chunks, const std::vector<Sequence*>& owners) {
  try {
    forward_and_sample(chunks, owners);
    return;
  } catch (const std::exception& e) {
    // Nothing was advanced. With one request in the step, it is the one that failed.
    if (std::all_of(owners.begin(), owners.end(), [&](const Sequence* s) { return s->req == owners[0]->req; })) {
      fail_request(owners[0]->req, e);
      return;
    }
  }
  // Several requests: run each alone (results do not depend on the batch), so that only those that fail by
  // themselves get the error. Rewriting the K/V of positions the failed step may have written is harmless.
  std::vector<Request*> reqs;
  for (const Sequence* s : owners)
    if (std::find(reqs.begin(), reqs.end(), s->req) == reqs.end()) reqs.push_back(s->req);
  for (Request* r : reqs) {
    std::vector<BatchChunk> sub;
    std::vector<Sequence*> sub_owners;
    for (size_t i = 0; i < owners.size(); ++i)
      if (owners[i]->req == r) {
        sub.push_back(chunks[i]);
        sub_owners.push_back(owners[i]);
      }
    try {
      forward_and_sample(sub, sub_owners);
    } catch (const std::exception& e) {
      fail_request(r, e);
    }
  }
}

bool ServingEngine::step() {
  cancel_requests();
  admit();
  std::vector<BatchChunk> chunks;
  std::vector<Sequence*> owners;
  const int64_t preempted_before = preemptions_.load();
  build_batch(chunks, owners);
  const bool worked = !chunks.empty();
  if (worked) {
    TraceScope trace(backend_->tracer(), "serve_step");
    trace_step_args(trace, chunks, preemptions_.load() - preempted_before);
    run_batch(chunks, owners);
  }

  // Retire finished sequences and requests.
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](Sequence* s) { return s->finished; }),
                 running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [](Sequence* s) { return s->finished; }),
                 waiting_.end());
  // Published before the final events: a client that has its answer sees the engine's numbers without it.
  publish_stats();
  bool retired = false;
  for (auto& r : requests_)
    if (r->open == 0 && !r->ended) {
      r->stream->push(GenerationEvent::make_done(r->usage));
      r->ended = true;
    }
  const auto before = requests_.size();
  requests_.erase(std::remove_if(requests_.begin(), requests_.end(),
                                 [](const std::unique_ptr<Request>& r) { return r->ended && r->open == 0; }),
                  requests_.end());
  retired = requests_.size() != before;
  publish_stats();
  return worked || retired;
}

void ServingEngine::trace_step_args(TraceScope& t, const std::vector<BatchChunk>& chunks, int64_t preempted) const {
  if (!backend_->tracer() || !backend_->tracer()->recording()) return;
  int64_t prefill = 0, decode = 0, groups = 0;
  std::vector<const ServeAdapter*> adapters;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const BatchChunk& c = chunks[i];
    (c.tokens.size() > 1 ? prefill : decode) += static_cast<int64_t>(c.tokens.size());
    if (c.adapter && (i == 0 || chunks[i - 1].adapter != c.adapter)) ++groups;  // a run of rows of one adapter
    if (c.adapter && std::find(adapters.begin(), adapters.end(), c.adapter) == adapters.end())
      adapters.push_back(c.adapter);
  }
  t.arg("prefill_tokens", static_cast<double>(prefill));
  t.arg("decode_rows", static_cast<double>(decode));
  t.arg("sequences", static_cast<double>(chunks.size()));
  t.arg("adapters", static_cast<double>(adapters.size()));
  t.arg("lora_groups", static_cast<double>(groups));
  t.arg("preempted", static_cast<double>(preempted));
  t.arg("kv_blocks_free", static_cast<double>(kv_->free_blocks()));
  t.arg("kv_blocks_total", static_cast<double>(kv_->n_blocks()));
  t.arg("waiting", static_cast<double>(waiting_.size()));
}

void ServingEngine::publish_stats() {
  // Sequences retired in this step may still be listed until its end.
  auto live = [](const auto& list) {
    return static_cast<int64_t>(std::count_if(list.begin(), list.end(), [](const Sequence* s) { return !s->finished; }));
  };
  n_running_.store(live(running_));
  n_waiting_.store(live(waiting_));
  kv_usage_.store(kv_->usage());
}

}  // namespace loom
