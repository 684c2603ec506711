// The serving engine behind `loom serve`: one scheduler thread owns the model,
// the paged KV cache and every running sequence, and runs continuous batching:
// each step, every running sequence decodes one token and waiting prompts are
// prefilled in chunks within a token budget, all in one BatchForward step.
// HTTP threads talk to it only through the Engine interface (engine_api.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "core/trace.h"
#include "dist/communicator.h"
#include "model/model.h"
#include "model/ngram_proposer.h"
#include "serve/adapter_registry.h"
#include "serve/batch_forward.h"
#include "serve/engine_api.h"
#include "serve/grammar_matcher.h"
#include "serve/kv_pool.h"
#include "serve/step_cost.h"
#include "serve/tp_adapters.h"

namespace loom {

// Where ServeOptions::fault_hook is called.
enum class FaultPoint { admit, forward, sample };

struct ServeOptions {
  std::string model_path;
  std::string model_name;  // the id clients use; default: the file or folder name
  std::vector<std::pair<std::string, std::string>> adapters;  // (name, folder) loaded at start
  std::vector<std::string> adapter_dirs;  // folders run-time loads may read from
  std::string chat_template;              // chatml, llama3, llama2 or mistral; empty: the model's metadata
  int64_t max_seqs = 64;                  // sequences decoding at once
  int64_t max_model_len = 0;              // 0: min(model context, 4096)
  size_t kv_cache_memory = 0;             // bytes of KV blocks; 0: max_seqs * max_model_len positions (capped at 2 GiB)
  DType kv_dtype = DType::f16;
  int64_t block_size = 16;
  int64_t max_loras = 8;                  // adapters resident at once
  size_t max_lora_memory = 0;             // bytes of resident adapters at most; 0: no limit but max_loras
  int lora_bits = 16;  // adapters kept in bf16 (as vLLM's lora_dtype auto), 32: f32, 8: int8, 4: 4 bits
  int64_t max_batch_tokens = 256;         // rows per step (decodes + prefill chunks)
  // Hardware-aware budgets (serve/step_cost.h): > 0: at start the step cost of
  // this machine is measured (or read from step_cost_dir's cache) and each
  // step's prefill tokens are chosen to keep the predicted step time, which is
  // the inter-token latency of every decoding sequence, within this many ms;
  // max_batch_tokens stays the upper limit. 0: the fixed budget.
  double itl_target_ms = 0;
  std::string step_cost_dir;     // empty: core/cache_dir.h's user_cache_dir(); "-": no cache
  bool remeasure_step_cost = false;
  // Scale the measured cost by the actual / predicted time of recent steps
  // (serve/step_cost.h StepCostCorrection); off: the measured cost as is.
  bool correct_step_cost = true;
  int threads = 0;                        // 0: physical cores
  Device device = kCpu;                   // which backend computes (kernels/backend.h)
  size_t max_waiting = 4096;              // queued requests before 503 overloaded
  // Prompt-lookup speculative decoding (`--spec-ngram K`): greedy requests get plain decoding's tokens;
  // sampled ones its distribution (speculative sampling; docs/serving.md).
  NgramSpecParams spec;
  // Steps with more decoding sequences than this draft nothing: a batch already uses the compute a
  // sequence's drafts would fill (vLLM's speculative disable_by_batch_size). 0: no limit.
  int64_t spec_max_batch = 2;
  // Tensor parallel (`loom serve --tp N` under mpirun): this process holds rank
  // tp->rank()'s shard of the heads and MLP channels (model/tensor_parallel.h);
  // rank 0 schedules and samples, the others follow its forward steps. Null: the whole model.
  Communicator* tp = nullptr;
  // Rank 0 of a tensor-parallel server whose start fails (a bad --adapter): called with the
  // error before the followers are told, so the error is written while they still wait (a
  // follower that exits first makes mpirun end rank 0, which then may never write it). The
  // caller reports it (loom serve: to stderr) and the error is then marked reported. The
  // followers report theirs the same way, and rank 0 ends only after all have (a barrier).
  std::function<void(const Error&)> report_startup_error;
  // Profiling (core/trace.h): the backend's ops and each scheduler step
  // ("serve_step") are recorded while it records. Null: nothing is recorded.
  Tracer* tracer = nullptr;
  // Fault injection for tests: when set, called on the scheduler thread when a sequence is admitted
  // (FaultPoint::admit), once per request in a forward step before the step runs (FaultPoint::forward) and
  // before each token of a sequence is sampled (FaultPoint::sample). An exception it throws is handled
  // exactly like a failure there: admission failing is a scheduler failure (every request in flight ends
  // with an error), a forward failure fails the requests that fail when run alone, a sampling failure fails
  // that request.
  std::function<void(FaultPoint, const GenerationRequest&)> fault_hook;
};

// What the step cost of a server with options `o` (resolved: max_batch_tokens
// at least max_seqs), `threads` threads and a KV cache of `kv_positions` is
// measured and cached under (serve/step_cost.h).
StepCostKey step_cost_key(const ServeOptions& o, int threads, int64_t kv_positions);

class ServingEngine : public Engine {
 public:
  // Loads the model and the start-up adapters and starts the scheduler thread.
  // Throws loom::Error for a bad model, adapter or option.
  explicit ServingEngine(ServeOptions options);
  ~ServingEngine() override;  // stops the scheduler; queued and running requests end with an error

  void submit(GenerationRequest request, std::shared_ptr<RequestStream> stream) override;
  std::vector<ModelInfo> list_models() override;
  // The registered adapters with their memory (for the start-up log).
  std::vector<AdapterInfo> adapter_infos() const { return adapters_.list(); }
  bool load_adapter(const std::string& name, const std::string& path, bool replace) override;
  void unload_adapter(const std::string& name) override;
  std::vector<int32_t> tokenize(const TokenizeRequest& request) override;
  std::string detokenize(const std::string& model, const std::vector<int32_t>& tokens) override;
  TokenizerInfo tokenizer_info() override;
  EngineHealth health() override;
  EngineStats stats() override;
  int64_t max_model_len() const override { return max_len_; }

  // Stops taking requests; the scheduler finishes what runs. Returns at once.
  void shutdown();
  // Tensor parallel, ranks other than 0: returns when rank 0's engine stops.
  void follow_until_stopped();
  const std::string& model_name() const { return name_; }
  const Model& model() const { return *model_; }
  bool tensor_parallel() const { return opt_.tp != nullptr && opt_.tp->size() > 1; }
  int64_t kv_blocks() const { return kv_->n_blocks(); }
  // The measured step cost (itl_target_ms > 0), else null; and where it is cached.
  const CachedStepCost* step_cost() const { return step_cost_ ? &*step_cost_ : nullptr; }
  // Actual / predicted step time, averaged over recent steps (1 without a step cost).
  double step_cost_scale() const { return step_scale_.load(std::memory_order_relaxed); }
  // Sequences preempted (blocks dropped, recomputed later) since start.
  int64_t preemptions() const { return preemptions_.load(); }
  // Speculation since start: tokens drafted, and drafted tokens the model agreed with.
  int64_t spec_draft_tokens() const { return spec_drafted_.load(); }
  int64_t spec_accepted_tokens() const { return spec_accepted_.load(); }

 private:
  struct Request;
  struct Sequence;

  void loop();
  // One scheduler iteration; false when there was nothing to do.
  bool step();
  void admit();
  void cancel_requests();
  // Chooses this step's rows: one decode row per running sequence (preempting when out of blocks), then
  // prefill chunks in what is left of the token budget.
  void build_batch(std::vector<BatchChunk>& chunks, std::vector<Sequence*>& owners);
  // Runs the rows and samples; a failure fails the requests it concerns, never the scheduler (below).
  void run_batch(const std::vector<BatchChunk>& chunks, const std::vector<Sequence*>& owners);
  // One forward over `chunks`, then per row: positions committed, and a token sampled where asked.
  // Throws what the forward throws (before any row was advanced); a failing sample fails its request only.
  void forward_and_sample(const std::vector<BatchChunk>& chunks, const std::vector<Sequence*>& owners);
  // Ends a request with an error event (EngineError as is, anything else as internal) and frees its blocks.
  void fail_request(Request* r, const std::exception& e);
  // Last resort when a step fails outside any one request: every request ends with an error and the
  // scheduler starts from an empty state (the KV pool keeps only its prefix cache).
  void recover(const std::exception& e);
  void preempt(Sequence* s);
  // A sequence is done (finished, cancelled or failed): frees its blocks.
  void retire(Sequence* s);
  // Samples, appends and streams one token; returns it (-1 when a grammar allowed none and the choice ended).
  // `draft` (>= 0): the token drafted for this position (Sampler::sample's speculative draw).
  int32_t sample_and_emit(Sequence* s, const float* logits, int32_t draft = -1);
  // The logprob of token `id` under one row of logits, with its `top` best alternatives.
  int64_t sampled_vocab() const;  // the ids sampling and logprobs cover: min(model rows, tokenizer)
  TokenLogprob token_logprob(const float* logits, int32_t id, int32_t top) const;
  // GenerationRequest::prompt_logprobs: the prompt positions rows [0, rows) of a chunk at n_past predict
  // (each row the next position), sent as a ChoiceDelta::prompt delta; the first token's entry has none.
  void emit_prompt_logprobs(Sequence* s, int64_t n_past, const float* logits, int64_t rows);
  // Speculation: puts [last token, drafts] in s's draft chunk and returns the number of drafts (0: none),
  // at most `spare`, backed by KV blocks.
  int64_t draft(Sequence* s, int64_t spare);
  // After a forward over [last token, drafts]: emits tokens while the model agrees with the drafts, then its
  // own.
  void accept_drafts(Sequence* s, std::span<const int32_t> drafts, const float* logits);
  // Embeddings: adds a chunk's hidden rows to the sum; at the prompt's end sends the vector and retires s.
  void pool_hidden(Sequence* s, const float* hidden, int64_t rows);
  void publish_stats();
  void measure_step_cost();
  // The start-up adapters (--adapter); with --tp rank 0 loads them and tells
  // the followers whether it could, so a failure ends every rank.
  void load_startup_adapters();
  // This step's row budget: the fixed max_batch_tokens, or with a step cost
  // the decode rows plus the prefill tokens that keep the target.
  int64_t step_budget(std::span<const BatchChunk> decode_chunks) const;
  // The "serve_step" phase's arguments: this step's rows, adapters and the KV pool.
  void trace_step_args(TraceScope& t, const std::vector<BatchChunk>& chunks, int64_t preempted) const;
  std::vector<int32_t> render_prompt(const GenerationRequest& r) const;

  ServeOptions opt_;
  std::string name_;
  int64_t created_ = 0;
  ThreadPool pool_;
  std::unique_ptr<Backend> backend_;
  ModelConfig full_config_;  // the whole model's shapes (model_'s are one tensor-parallel rank's)
  std::unique_ptr<Model> model_;
  int64_t max_len_ = 0;
  std::vector<int32_t> eos_ids_;
  std::unique_ptr<TokenTrie> vocab_trie_;  // the tokens' bytes, for structured outputs' masks
  std::unique_ptr<ChatTemplate> template_;
  std::unique_ptr<KvPool> kv_;
  std::unique_ptr<BatchForward> forward_;
  std::optional<CachedStepCost> step_cost_;
  StepCostCorrection step_correction_;  // scheduler thread only
  AdapterRegistry adapters_;            // rank 0's (followers register nothing: tp_receiver_)
  // Tensor parallel: rank 0 sends the followers the adapters a step uses, a follower keeps them.
  std::unique_ptr<TpAdapterSender> tp_sender_;
  std::unique_ptr<TpAdapterReceiver> tp_receiver_;

  // HTTP threads -> scheduler
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> incoming_;
  bool stopping_ = false;

  // Scheduler thread only
  std::vector<std::unique_ptr<Request>> requests_;  // admitted or waiting, in arrival order
  std::deque<Sequence*> waiting_;                   // not running: new, or preempted (front)
  std::vector<Sequence*> running_;                  // in admission order (the newest last)
  uint64_t admit_counter_ = 0;

  std::atomic<bool> abort_{false};
  std::atomic<int64_t> preemptions_{0};  // end every request now (destructor)
  std::atomic<int64_t> spec_drafted_{0}, spec_accepted_{0};
  std::atomic<int64_t> n_running_{0}, n_waiting_{0};
  std::atomic<double> kv_usage_{0};
  std::atomic<double> step_scale_{1};
  std::thread thread_;
};

}  // namespace loom
