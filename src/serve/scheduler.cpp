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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <random>
#include <stdexcept>

#include "core/cache_dir.h"
#include "core/cpu_features.h"
#include "kernels/cpu/logit_row.h"
#include "kernels/profiling_backend.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "model/tensor_parallel.h"
#include "serve/grammar_vocab.h"
#include "serve/tp_link.h"
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
  std::unique_ptr<GrammarMatcher> grammar;  // structured output: this choice's grammar state
  bool finished = false;
  std::vector<int32_t> spec_chunk;  // speculation: [last token, drafts] of the current step
  int64_t draft_length = -1;        // speculation: most drafts next step (next_draft_length); -1: not yet
  std::vector<double> pooled;       // embeddings: sum of the final-norm hidden rows so far
  // prompt_logprobs: the next prompt position to report (a recomputation reports none twice).
  int64_t prompt_logprobs_next = 0;

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
  bool speculate = false;  // prompt-lookup drafts (greedy requests of a --spec-ngram server)
  std::shared_ptr<const LoadedAdapter> adapter;  // acquired when first admitted
  std::vector<std::unique_ptr<Sequence>> seqs;
  int64_t open = 0;  // unfinished choices
  Usage usage;
  bool ended = false;  // done or error sent
};

namespace {

// Rows of a prompt-logprobs request's prefill chunk (GenerationRequest::prompt_logprobs): each keeps its
// logits (a vocabulary of floats), so the chunk is bounded.
constexpr int64_t kPromptLogprobRows = 64;

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

// A tensor-parallel rank other than 0: it follows rank 0's steps.
bool is_follower(const ServeOptions& o) { return o.tp != nullptr && o.tp->size() > 1 && o.tp->rank() != 0; }

// The model, or with ServeOptions::tp this rank's shard of it; `full`: the whole model's shapes.
std::unique_ptr<Model> load_serve_model(const ServeOptions& o, Backend& backend, ModelConfig& full) {
  Model::LoadOptions lo{.tokenizer = true, .pack = true, .backend = &backend};
  const int ranks = o.tp != nullptr ? o.tp->size() : 1;
  if (ranks > 1)
    lo.before_pack = [&](ModelWeights& w, const ModelConfig& c) {
      shard_weights_for_tensor_parallel(w, c, o.tp->rank(), ranks);
    };
  std::unique_ptr<Model> m = Model::load(o.model_path, lo);
  full = m->config();
  if (ranks > 1) m->reshape(tensor_parallel_config(m->config(), ranks));
  return m;
}

// A step of a choice's grammar; a grammar too ambiguous to enforce (GrammarAutomaton::limit_work) fails
// its request as a bad request, not as the server's fault.
template <typename Step>
auto grammar_step(const GenerationRequest& g, int64_t choice, Step step) {
  try {
    return step();
  } catch (const GrammarError& e) {
    throw EngineError(EngineErrc::invalid_request,
                      fmt::format("structured output of choice {}: {}", choice, e.what()),
                      g.grammar ? g.grammar->source_param : std::string());
  }
}

// A tensor-parallel start's error, written (ServeOptions::report_startup_error) once.
void report_startup_error_once(const ServeOptions& opt, Error& e) {
  if (!opt.report_startup_error || e.reported()) return;
  opt.report_startup_error(e);
  e.set_reported();
}
}  // namespace

ServingEngine::ServingEngine(ServeOptions options)
    : opt_(std::move(options)),
      pool_(opt_.threads > 0 ? opt_.threads : default_thread_count()),
      backend_(make_serve_backend(opt_, pool_)),
      model_(load_serve_model(opt_, *backend_, full_config_)),
      // A follower loads nothing itself, so it needs no --adapter-dir (which may not exist on its host).
      adapters_(full_config_, is_follower(opt_) ? std::vector<std::string>{} : opt_.adapter_dirs,
                opt_.max_loras, opt_.lora_bits, opt_.max_lora_memory,
                opt_.tp != nullptr ? opt_.tp->size() : 1) {
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
  if (!(opt_.itl_target_ms >= 0) || !std::isfinite(opt_.itl_target_ms))
    fail(ErrorKind::invalid_input, "--itl-target-ms must be a finite number >= 0 (0: off), not {}", opt_.itl_target_ms);

  const Tokenizer& tok = model_->tokenizer();
  eos_ids_ = model_->extra_eos_ids();
  vocab_trie_ = make_token_trie(model_->tokenizer());
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
  if (opt_.itl_target_ms > 0) measure_step_cost();
  load_startup_adapters();
  if (is_follower(opt_))
    thread_ = std::thread([this] { forward_->follow(*tp_receiver_); });
  else
    thread_ = std::thread([this] { loop(); });
}

void ServingEngine::load_startup_adapters() {
  if (is_follower(opt_)) {
    tp_receiver_ = std::make_unique<TpAdapterReceiver>(*opt_.tp, model_->config(), opt_.lora_bits);
    if (!tp_agree_started(*opt_.tp, true)) {
      // Written before rank 0 may end: mpirun ends every rank once one exits with an error.
      Error e(ErrorKind::invalid_input,
              "rank 0 of the tensor-parallel server did not start (its log says why)");
      report_startup_error_once(opt_, e);
      opt_.tp->barrier();  // (rank 0 waits here until every follower has written its error)
      throw e;
    }
    return;
  }
  try {
    for (const auto& [name, dir] : opt_.adapters) {
      if (name == name_) fail(ErrorKind::invalid_input, "--adapter {}: the name is the base model's", name);
      adapters_.add(name, dir, /*runtime=*/false);
    }
  } catch (Error& e) {
    if (tensor_parallel()) {
      report_startup_error_once(opt_, e);
      tp_agree_started(*opt_.tp, false);
      opt_.tp->barrier();  // every follower has written why it ends
    }
    throw;
  } catch (...) {
    if (tensor_parallel()) {
      tp_agree_started(*opt_.tp, false);
      opt_.tp->barrier();
    }
    throw;
  }
  if (tensor_parallel()) {
    tp_agree_started(*opt_.tp, true);
    tp_sender_ = std::make_unique<TpAdapterSender>(*opt_.tp);
  }
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
        throw EngineError(
            EngineErrc::invalid_request,
            fmt::format("token id {} is outside the vocabulary [0, {})", id, model_->config().vocab_size),
            r.kind == RequestKind::embedding ? "input" : "prompt");
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
  for (const int32_t id : g.stop_token_ids)  // one no token can be would never stop anything
    if (id < 0 || id >= model_->config().vocab_size)
      throw EngineError(
          EngineErrc::invalid_request,
          fmt::format("stop token id {} is outside the vocabulary [0, {})", id, model_->config().vocab_size),
          "stop_token_ids");
  const bool embedding = g.kind == RequestKind::embedding;
  const char* prompt_param = g.kind == RequestKind::chat ? "messages" : embedding ? "input" : "prompt";
  const auto n_prompt = static_cast<int64_t>(r->prompt.size());
  if (n_prompt == 0) throw EngineError(EngineErrc::invalid_request, "the prompt is empty", prompt_param);
  if (embedding) {
    if (n_prompt > max_len_)
      throw EngineError(
          EngineErrc::context_length_exceeded,
          fmt::format("This model's maximum context length is {} tokens. However, your input has {} "
                      "tokens.",
                      max_len_, n_prompt),
          prompt_param);
    g.max_tokens = 0;
    g.n = 1;
  } else if (n_prompt >= max_len_) {
    throw EngineError(EngineErrc::context_length_exceeded,
                      fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} "
                                  "tokens, leaving no room to generate.",
                                  max_len_, n_prompt),
                      prompt_param);
  }
  r->max_new = g.max_tokens < 0 ? max_len_ - n_prompt : g.max_tokens;
  if (n_prompt + r->max_new > max_len_)
    throw EngineError(EngineErrc::context_length_exceeded,
                      fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                  "tokens ({} in the {}, {} for the completion).",
                                  max_len_, n_prompt + r->max_new, n_prompt, prompt_param, r->max_new),
                      "max_tokens");
  if (g.n < 1) throw EngineError(EngineErrc::invalid_request, "n must be at least 1", "n");
  r->usage.prompt_tokens = n_prompt;
  r->speculate = opt_.spec.enabled() && !embedding && !g.prompt_logprobs;
  const uint64_t base_seed = g.seed ? *g.seed : fresh_seed();
  const Tokenizer& tok = model_->tokenizer();
  for (int32_t i = 0; i < g.n; ++i) {
    SamplingParams sp = g.sampling;
    sp.seed = base_seed + static_cast<uint64_t>(i);
    auto s = std::make_unique<Sequence>(r.get(), i, sp, sampled_vocab(), tok, g.stop);
    s->tokens = r->prompt;
    if (g.grammar)
      s->grammar = grammar_step(g, g.first_choice_index + i, [&] {
        return std::make_unique<GrammarMatcher>(g.grammar, *vocab_trie_, grammar_end_ids(tok, eos_ids_, g));
      });
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

bool ServingEngine::load_adapter(const std::string& name, const std::string& path, bool replace) {
  if (name == name_)
    throw EngineError(EngineErrc::adapter_exists, "'" + name + "' is the base model's name", "lora_name");
  return adapters_.add(name, path, /*runtime=*/true, replace);
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

TokenizerInfo ServingEngine::tokenizer_info() {
  const Tokenizer& tok = model_->tokenizer();
  auto piece = [&](int32_t id) {
    return id < 0 ? std::nullopt : std::optional<std::string>(tok.token_to_piece(id));
  };
  TokenizerInfo info;
  info.bos_token = piece(tok.bos());
  info.eos_token = piece(tok.eos());
  info.add_bos_token = tok.add_bos() && tok.bos() >= 0;
  info.chat_template = model_->chat_template_text();
  return info;
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
  s.spec_draft_tokens = spec_drafted_.load();
  s.spec_accepted_tokens = spec_accepted_.load();
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
  s->pooled.clear();
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
    // An embedding needs every position's hidden state, prompt logprobs every position's logits: nothing is
    // taken from the prefix cache for them.
    const int64_t cached =
        r->g.kind == RequestKind::embedding || r->g.prompt_logprobs
            ? 0
            : kv_->match_prefix(s->table, std::span<const int32_t>(s->tokens.data(), n - 1));
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

int64_t ServingEngine::sampled_vocab() const {
  // A model vocabulary padded past its tokenizer (Qwen2: 151,936 rows for 151,665 tokens): the padded ids
  // stand for no text; they are never sampled nor listed.
  return std::min<int64_t>(model_->config().vocab_size, model_->tokenizer().vocab_size());
}

TokenLogprob ServingEngine::token_logprob(const float* logits, int32_t id, int32_t top) const {
  // Log-probabilities of the model's distribution (raw logits, before sampling filters).
  const Tokenizer& tok = model_->tokenizer();
  const int64_t V = sampled_vocab();
  const double lse = logsumexp(logits, V);
  TokenLogprob lp;
  lp.token_id = id;
  lp.token = tok.token_to_piece(id);
  lp.logprob = static_cast<float>(logits[id] - lse);
  const int64_t k = std::min<int64_t>(top, V);
  if (k > 0) {
    std::vector<int32_t> best(static_cast<size_t>(k));
    top_k(logits, V, k, best.data());
    for (const int32_t t : best)
      lp.top.push_back({t, tok.token_to_piece(t), static_cast<float>(logits[t] - lse)});
  }
  return lp;
}

void ServingEngine::emit_prompt_logprobs(Sequence* s, int64_t n_past, const float* logits, int64_t rows) {
  Request* r = s->req;
  const int64_t V = model_->config().vocab_size, n_prompt = static_cast<int64_t>(r->prompt.size());
  ChoiceDelta d;
  d.index = r->g.first_choice_index + s->choice;
  d.prompt = true;
  if (s->prompt_logprobs_next == 0) {  // the first token: nothing before it predicts it
    TokenLogprob first;
    first.token_id = r->prompt[0];
    first.token = model_->tokenizer().token_to_piece(first.token_id);
    first.known = false;
    d.logprobs.push_back(std::move(first));
    s->prompt_logprobs_next = 1;
  }
  // Row i's logits predict the token at position n_past + i + 1.
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = n_past + i + 1;
    if (at < s->prompt_logprobs_next || at >= n_prompt) continue;
    d.logprobs.push_back(
        token_logprob(logits + i * V, r->prompt[static_cast<size_t>(at)], r->g.top_logprobs));
    s->prompt_logprobs_next = at + 1;
  }
  if (!d.logprobs.empty()) r->stream->push(GenerationEvent::make_delta(std::move(d)));
}

int32_t ServingEngine::sample_and_emit(Sequence* s, const float* logits, int32_t draft) {
  Request* r = s->req;
  const Tokenizer& tok = model_->tokenizer();
  const int64_t V = model_->config().vocab_size;
  ChoiceDelta d;
  d.index = r->g.first_choice_index + s->choice;
  // Structured output: tokens the grammar does not allow get -inf before penalties and filters. When none
  // is allowed the choice ends: "stop" if its text is a whole match, else "length" (cut short).
  const float* sample_from =
      s->grammar ? grammar_step(r->g, d.index, [&] { return s->grammar->masked_logits(logits, V); }) : logits;
  if (sample_from == nullptr) {
    d.text = s->stop.push(s->decoder.finish());
    if (!s->stop.stopped()) d.text += s->stop.flush();
    d.finish = s->grammar->complete() ? FinishKind::stop : FinishKind::length;
    r->stream->push(GenerationEvent::make_delta(std::move(d)));
    retire(s);
    return -1;
  }
  const int32_t id = s->sampler.sample(sample_from, s->generated, draft);
  if (s->grammar && !grammar_step(r->g, d.index, [&] { return s->grammar->accept(id); }))
    throw EngineError(EngineErrc::internal, fmt::format("the sampled token {} is not allowed by the grammar", id));
  d.token_ids.push_back(id);
  if (r->g.logprobs) d.logprobs.push_back(token_logprob(logits, id, r->g.top_logprobs));
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
  return id;
}

int64_t ServingEngine::draft(Sequence* s, int64_t spare) {
  const auto n = static_cast<int64_t>(s->tokens.size());
  // The last token a sequence keeps is never computed: drafts beyond max_tokens or the context are useless.
  const int64_t room =
      std::min({spare, s->req->max_new - static_cast<int64_t>(s->generated.size()) - 1, max_len_ - n - 1});
  std::vector<int32_t>& chunk = s->spec_chunk;
  chunk.clear();
  if (s->draft_length < 0) s->draft_length = opt_.spec.num_draft;
  if (room <= 0) return 0;
  propose_ngram_drafts(s->tokens, opt_.spec, std::min(room, s->draft_length), chunk);
  auto k = static_cast<int64_t>(chunk.size());
  if (k == 0) return 0;
  // Blocks for the drafts' positions while the pool keeps its admission margin; a guess never preempts.
  const int64_t watermark = std::max<int64_t>(1, kv_->n_blocks() / 100);
  if (kv_->free_blocks() - kv_->blocks_needed(s->table, n + k) < watermark || !kv_->reserve(s->table, n + k))
    k = std::min(k, s->table.n_blocks() * kv_->block_size() - n);
  if (k <= 0) {
    chunk.clear();
    return 0;
  }
  chunk.resize(static_cast<size_t>(k));
  chunk.insert(chunk.begin(), s->tokens.back());
  return k;
}

void ServingEngine::accept_drafts(Sequence* s, std::span<const int32_t> drafts, const float* logits) {
  const int64_t V = model_->config().vocab_size;
  spec_drafted_.fetch_add(static_cast<int64_t>(drafts.size()));
  for (size_t j = 0;; ++j) {
    const int32_t id = sample_and_emit(s, logits + static_cast<int64_t>(j) * V, j < drafts.size() ? drafts[j] : -1);
    if (j == drafts.size() || id != drafts[j]) {
      s->draft_length =
          next_draft_length(opt_.spec, static_cast<int64_t>(j), static_cast<int64_t>(drafts.size()));
      break;
    }
    spec_accepted_.fetch_add(1);
    if (s->finished) return;
    // The draft's K/V, written by this step, are the sequence's now; a rejected draft's slot is overwritten
    // by the next step and never registered in the prefix cache (positions >= n_computed).
    ++s->n_computed;
  }
  if (!s->finished) kv_->commit_full_blocks(s->table, s->tokens, s->n_computed);
}

void ServingEngine::pool_hidden(Sequence* s, const float* hidden, int64_t rows) {
  const int64_t H = model_->config().hidden;
  std::vector<double>& sum = s->pooled;
  sum.resize(static_cast<size_t>(H), 0.0);
  // Row after row in position order: the same sums however the prompt was cut into chunks.
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < H; ++i) sum[static_cast<size_t>(i)] += hidden[t * H + i];
  const auto n = static_cast<int64_t>(s->tokens.size());
  if (s->n_computed < n) return;
  // Mean, then L2 normalization as llama-server's /v1/embeddings (--pooling mean, --embd-normalize 2).
  std::vector<float> mean(static_cast<size_t>(H));
  for (int64_t i = 0; i < H; ++i)
    mean[static_cast<size_t>(i)] = static_cast<float>(sum[static_cast<size_t>(i)] / static_cast<double>(n));
  double norm = 0;
  for (float v : mean) norm += static_cast<double>(v) * v;
  norm = std::sqrt(norm);
  const double scale = norm > 0 ? 1.0 / norm : 0.0;
  for (float& v : mean) v = static_cast<float>(v * scale);
  ChoiceDelta d;
  d.index = s->req->g.first_choice_index;
  d.embedding = std::move(mean);
  d.finish = FinishKind::stop;
  s->req->stream->push(GenerationEvent::make_delta(std::move(d)));
  retire(s);
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
  const size_t first_decode = chunks.size();
  int64_t budget = opt_.max_batch_tokens;
  // Speculating sequences verify drafts in the rows the decode rows leave over (oldest first).
  const int64_t n_decode = std::count_if(running_.begin(), running_.end(), [](const Sequence* s) {
    return !s->finished && static_cast<int64_t>(s->tokens.size()) - s->n_computed == 1;
  });
  int64_t spare = opt_.spec_max_batch > 0 && n_decode > opt_.spec_max_batch ? 0 : budget - n_decode;
  for (Sequence* s : running_) {
    const auto n = static_cast<int64_t>(s->tokens.size());
    if (s->finished || n - s->n_computed != 1) continue;
    const bool embedding = s->req->g.kind == RequestKind::embedding;
    BatchChunk c;
    c.table = &s->table;
    c.n_past = s->n_computed;
    c.tokens = std::span<const int32_t>(s->tokens.data() + s->n_computed, 1);
    c.adapter = s->req->adapter ? &s->req->adapter->view : nullptr;
    c.adapter_id = s->req->adapter ? s->req->adapter->id : 0;
    c.want_logits = !embedding;
    c.want_hidden = embedding;
    if (s->req->speculate && spare > 0) {
      if (const int64_t k = draft(s, spare); k > 0) {
        c.tokens = s->spec_chunk;
        c.logit_rows = 1 + k;
        spare -= k;
        budget -= k;
      }
    }
    chunks.push_back(c);
    owners.push_back(s);
  }
  budget = step_budget(std::span<const BatchChunk>(chunks).subspan(first_decode));
  // Prefill chunks, oldest first, in what is left of the budget.
  for (Sequence* s : running_) {
    if (budget <= 0) break;
    const auto n = static_cast<int64_t>(s->tokens.size());
    if (s->finished || n - s->n_computed <= 1) continue;
    const bool prompt_logprobs = s->req->g.prompt_logprobs;
    int64_t len = std::min(budget, n - s->n_computed);
    if (prompt_logprobs) len = std::min(len, kPromptLogprobRows);
    BatchChunk c;
    c.table = &s->table;
    c.n_past = s->n_computed;
    c.tokens = std::span<const int32_t>(s->tokens.data() + s->n_computed, static_cast<size_t>(len));
    c.adapter = s->req->adapter ? &s->req->adapter->view : nullptr;
    c.adapter_id = s->req->adapter ? s->req->adapter->id : 0;
    c.want_hidden = s->req->g.kind == RequestKind::embedding;
    c.want_logits = !c.want_hidden && (prompt_logprobs || s->n_computed + len == n);
    if (prompt_logprobs) {
      c.logit_rows = len;
      c.prompt_logprobs = true;
    }
    chunks.push_back(c);
    owners.push_back(s);
    budget -= len;
  }
}

StepCostKey step_cost_key(const ServeOptions& o, int threads, int64_t kv_positions) {
  StepCostKey key;
  key.cpu = cpu_model_name();
  const char* mask = std::getenv("LOOM_CPU");
  key.cpu_mask = mask ? mask : "";
  key.build = executable_identity();
  key.model = file_identity(o.model_path);
  key.threads = threads;
  key.kv_dtype = dtype_name(o.kv_dtype);
  key.block_size = o.block_size;
  key.max_rows = std::min(o.max_batch_tokens, kv_positions);
  key.max_decode_rows = std::min(o.max_seqs, key.max_rows);
  return key;
}

void ServingEngine::measure_step_cost() {
  if (tensor_parallel())
    fail(ErrorKind::unsupported, "--itl-target-ms with --tp: the step cost of a tensor-parallel server is not measured yet");
  const StepCostKey key = step_cost_key(opt_, pool_.size(), kv_->n_blocks() * kv_->block_size());
  const std::string& d = opt_.step_cost_dir;
  const std::string dir = d.empty() ? user_cache_dir() : d == "-" ? std::string() : d;
  step_cost_ = load_or_measure_step_cost(*forward_, *kv_, model_->config().vocab_size, max_len_, key,
                                         2 * opt_.itl_target_ms, dir, opt_.remeasure_step_cost);
}

int64_t ServingEngine::step_budget(std::span<const BatchChunk> decode_chunks) const {
  int64_t decode_rows = 0;  // one per sequence, more where drafts are verified
  for (const BatchChunk& c : decode_chunks) decode_rows += static_cast<int64_t>(c.tokens.size());
  const int64_t left = opt_.max_batch_tokens - decode_rows;
  if (!step_cost_) return left;
  StepLoad load;
  load.decode_rows = decode_rows;
  for (const BatchChunk& c : decode_chunks) load.decode_attended += static_cast<double>(c.n_past);
  for (const Sequence* s : running_)
    if (!s->finished && static_cast<int64_t>(s->tokens.size()) - s->n_computed > 1) {
      load.prefill_past = s->n_computed;
      break;
    }
  return prefill_budget(step_cost_->cost, load, opt_.itl_target_ms / step_correction_.scale(), left,
                        opt_.block_size);
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
  if (tp_sender_) {  // the followers get the adapters this step uses before the step
    std::vector<std::shared_ptr<const LoadedAdapter>> used;
    for (const Sequence* s : owners) used.push_back(s->req->adapter);
    tp_sender_->sync(used);
  }
  {
    const TraceScope trace(backend_->tracer(), "forward");
    forward_->step(chunks);
  }
  const TraceScope trace(backend_->tracer(), "sample");  // sampling, detokenizing, streaming
  for (size_t i = 0; i < chunks.size(); ++i) {
    Sequence* s = owners[i];
    if (s->finished) continue;  // its request failed at an earlier row of this step
    const BatchChunk& c = chunks[i];
    // A speculating row's drafts count only once accepted (accept_drafts).
    const int64_t drafts = c.want_logits && !c.prompt_logprobs ? c.logit_rows - 1 : 0;
    s->n_computed += static_cast<int64_t>(c.tokens.size()) - drafts;
    if (c.want_hidden) {  // embeddings: their blocks are freed at the end, never cached
      pool_hidden(s, forward_->hidden(i), static_cast<int64_t>(c.tokens.size()));
      continue;
    }
    kv_->commit_full_blocks(s->table, s->tokens, s->n_computed);
    if (!c.want_logits) continue;
    try {
      if (opt_.fault_hook) opt_.fault_hook(FaultPoint::sample, s->req->g);
      const float* logits = forward_->logits(i);
      if (c.prompt_logprobs) {
        emit_prompt_logprobs(s, c.n_past, logits, c.logit_rows);
        if (s->n_computed < static_cast<int64_t>(s->tokens.size())) continue;  // more of the prompt to come
        logits += (c.logit_rows - 1) * model_->config().vocab_size;            // the last row samples
      }
      if (drafts == 0)
        sample_and_emit(s, logits);
      else
        accept_drafts(s, c.tokens.subspan(1), logits);
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
    const auto t0 = std::chrono::steady_clock::now();
    run_batch(chunks, owners);
    if (step_cost_ && opt_.correct_step_cost) {
      StepShape shape;
      for (const BatchChunk& c : chunks) shape.add(static_cast<int64_t>(c.tokens.size()), c.n_past);
      step_correction_.observe(
          step_cost_->cost.predict_ms(shape.decode_rows, shape.prefill_tokens, shape.attended),
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      step_scale_.store(step_correction_.scale(), std::memory_order_relaxed);
    }
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
    const bool decode_row =
        c.want_logits && c.logit_rows == static_cast<int64_t>(c.tokens.size());  // drafts too
    (decode_row ? decode : prefill) += static_cast<int64_t>(c.tokens.size());
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
