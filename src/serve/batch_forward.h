// One decoder forward step over a batch of sequences that share the paged KV
// cache (continuous batching): decode rows and chunked-prefill rows of many
// sequences go through every weight matmul together, each sequence with its
// own LoRA adapter (or none).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "dist/communicator.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "serve/kv_pool.h"
#include "serve/lora_set.h"

namespace loom {

class TpAdapterReceiver;

// The new tokens of one sequence in a step.
struct BatchChunk {
  const BlockTable* table = nullptr;      // must already hold positions [0, n_past + tokens.size())
  int64_t n_past = 0;                     // positions [0, n_past) are in the cache
  std::span<const int32_t> tokens;        // 1 for a decode step, more for a prefill chunk
  const ServeAdapter* adapter = nullptr;  // null: the base model; validated by its loader
  bool want_logits = false;               // logits of the chunk's last `logit_rows` tokens
  int64_t logit_rows = 1;    // with want_logits: 1..tokens.size() (speculative verification: all)
  bool want_hidden = false;  // final-norm hidden state of every token (embeddings)
  // Tensor parallel: `adapter`'s LoadedAdapter::id, which names it to the followers (last: callers
  // initialize the fields above by position).
  int64_t adapter_id = 0;
  // The scheduler's mark, not read here: every row's logits are asked for (logit_rows == tokens.size())
  // as the prompt's log-probabilities (GenerationRequest::prompt_logprobs), not to verify drafts.
  bool prompt_logprobs = false;
};

// Results are batch invariant: a chunk's logits and the K/V rows it writes
// are bit-identical whatever other chunks share the step, whatever the thread
// count, and wherever its blocks sit. (Every backend op computes each row on its
// own in a fixed order; see kernels/backend.h and kernels/cpu/paged_attention.h.)
// The output equals InferenceSession's up to the attention's summation order.
class BatchForward {
 public:
  // max_batch_tokens: most rows (sum of chunk lengths) in one step.
  // max_logit_rows: how many logits rows to allocate up front (more grow the buffer).
  // `weights` must be prepared for `backend`.
  BatchForward(const ModelConfig& config, const ModelWeights& weights, Backend& backend, KvPool& kv,
               int64_t max_batch_tokens, int64_t max_logit_rows = 64);
  ~BatchForward();

  // Runs the step: writes K/V of every new position into the chunk's blocks
  // and computes the logits asked for. Chunks must belong to distinct
  // sequences, and the blocks they write must be theirs alone (ref count 1).
  // Throws invalid_input for a token id outside the vocabulary (nothing is
  // written then).
  void step(std::span<const BatchChunk> chunks);

  // Logits [logit_rows, vocab] of chunk i of the last step; null when it asked for none.
  const float* logits(size_t chunk) const;
  // Final-norm hidden states [tokens, hidden] of chunk i of the last step; null when it asked for none.
  const float* hidden(size_t chunk) const;
  int64_t vocab_size() const { return c_.vocab_size; }

  // Tensor parallel (`loom serve --tp N`; model/tensor_parallel.h): the weights,
  // the KV cache and the adapters hold rank comm->rank()'s shard of the heads.
  // Rank 0's step() first sends the step (tokens, positions, block ids, each
  // chunk's adapter id) to the other ranks (serve/tp_link.h), whose follow()
  // runs the same steps (without logits), with the adapters `adapters` holds
  // (rank 0's TpAdapterSender sent them before the step), until rank 0's
  // stop_followers().
  void set_tensor_parallel(Communicator* comm);
  void follow(TpAdapterReceiver& adapters);
  void stop_followers();
  int64_t max_batch_tokens() const { return max_tokens_; }

 private:
  class PagedAttention;
  class RowAdapters;
  void prepare(std::span<const BatchChunk> chunks);
  void run_step();
  void send_step(std::span<const BatchChunk> chunks);
  void follow_step(std::span<const int64_t> msg, const TpAdapterReceiver& adapters);

  const ModelConfig& c_;
  Decoder dec_;
  KvPool& kv_;
  int64_t max_tokens_;
  std::unique_ptr<Workspace> ws_;

  // Per step
  int64_t T_ = 0;
  std::vector<int32_t> tokens_;                   // [T] the step's tokens, chunk after chunk
  std::vector<int32_t> pos_;                      // [T] position of each row
  std::vector<int64_t> kv_slot_;                  // [T] KV slot of each row's position
  std::vector<const int32_t*> tables_;            // [T] block ids of each row's sequence
  std::vector<const ServeAdapter*> row_adapter_;  // [T]
  std::vector<int32_t> lora_rows_;                // rows with an adapter, one adapter's rows adjacent
  int64_t lora_rank_ = 0;                         // largest rank among this step's adapters
  // A step reads every layer's weights, so a layer's LoRA factors are still in
  // cache at the next step only when the weights and this step's distinct
  // adapters together fit the last-level cache (`llc_bytes_`, 0: unknown).
  // Otherwise (`lora_cold_`) the LoRA kernel prefetches the factors ahead.
  bool lora_cold_ = false;
  size_t llc_bytes_ = 0, weight_bytes_ = 0;
  std::vector<float> lora_u_;                     // [3, T, lora_rank_] scale * A x
  std::vector<int64_t> logit_row_;                // per chunk: index into logits_, or -1
  std::vector<int64_t> logit_src_;                // per logits row: the batch row it comes from
  std::vector<int64_t> hidden_row_;               // per chunk: first row of it in hidden_, or -1
  std::vector<int64_t> hidden_src_;               // per hidden row: the batch row it comes from
  std::unique_ptr<PagedAttention> attention_;
  std::unique_ptr<RowAdapters> adapters_;
  Communicator* tp_ = nullptr;  // tensor parallel; null: the whole model
  bool following_ = false;      // a tensor-parallel rank other than 0, in follow()
  std::unique_ptr<PartialSums> sums_;
  StepActivations acts_;
  std::vector<float> logits_;  // [logit rows, vocab]
  std::vector<float> hidden_;  // [hidden rows, hidden]
};

}  // namespace loom
