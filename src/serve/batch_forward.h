// One decoder forward step over a batch of sequences that share the paged KV
// cache (continuous batching): decode rows and chunked-prefill rows of many
// sequences go through every weight matmul together, each sequence with its
// own LoRA adapter (or none).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/matmul.h"
#include "model/config.h"
#include "model/weights.h"
#include "serve/kv_pool.h"
#include "serve/lora_set.h"

namespace loom {

// The new tokens of one sequence in a step.
struct BatchChunk {
  const BlockTable* table = nullptr;      // must already hold positions [0, n_past + tokens.size())
  int64_t n_past = 0;                     // positions [0, n_past) are in the cache
  std::span<const int32_t> tokens;        // 1 for a decode step, more for a prefill chunk
  const ServeAdapter* adapter = nullptr;  // null: the base model; validated by its loader
  bool want_logits = false;               // logits of the chunk's last token
};

// Results are batch invariant: a chunk's logits and the K/V rows it writes
// are bit-identical whatever other chunks share the step, whatever the thread
// count, and wherever its blocks sit. (Every kernel used computes each row on
// its own in a fixed order; see kernels/matmul.h and kernels/paged_attention.h.)
// The output equals InferenceSession's up to the attention's summation order.
class BatchForward {
 public:
  // max_batch_tokens: most rows (sum of chunk lengths) in one step.
  // max_logit_rows: how many logits rows to allocate up front (more grow the buffer).
  BatchForward(const ModelConfig& config, const ModelWeights& weights, ThreadPool& pool, KvPool& kv,
               int64_t max_batch_tokens, int64_t max_logit_rows = 64);

  // Runs the step: writes K/V of every new position into the chunk's blocks
  // and computes the logits asked for. Chunks must belong to distinct
  // sequences, and the blocks they write must be theirs alone (ref count 1).
  // Throws invalid_input for a token id outside the vocabulary (nothing is
  // written then).
  void step(std::span<const BatchChunk> chunks);

  // Logits [vocab] of chunk i of the last step; null when it asked for none.
  const float* logits(size_t chunk) const;
  int64_t vocab_size() const { return c_.vocab_size; }
  int64_t max_batch_tokens() const { return max_tokens_; }

 private:
  // One LoRA product of a layer: y[row] += scale * B (A x[row]) for rows whose
  // chunk has an adapter with this target.
  struct LoraJob {
    LoraTarget target;
    const float* x;
    int64_t ldx;
    float* y;
    int64_t ldy;
  };
  void prepare(std::span<const BatchChunk> chunks);
  void apply_lora(int64_t layer, std::span<const LoraJob> jobs);
  void rope_and_store(int64_t layer);
  void swiglu_rows();

  const ModelConfig& c_;
  const ModelWeights& w_;
  ThreadPool& pool_;
  KvPool& kv_;
  int64_t max_tokens_;
  MatmulScratch scratch_;

  // Per step
  int64_t T_ = 0;
  std::vector<int32_t> pos_;                      // [T] position of each row
  std::vector<int64_t> kv_slot_;                  // [T] KV slot of each row's position
  std::vector<const int32_t*> tables_;            // [T] block ids of each row's sequence
  std::vector<float> rope_cs_;                    // [T, head_dim] cos | sin of each row's angles
  std::vector<const ServeAdapter*> row_adapter_;  // [T]
  std::vector<int32_t> lora_rows_;                // rows with an adapter
  int64_t lora_rank_ = 0;                         // largest rank among this step's adapters
  std::vector<float> lora_u_;                     // [3, T, lora_rank_] scale * A x
  std::vector<int64_t> logit_row_;                // per chunk: index into logits_, or -1
  std::vector<int64_t> logit_src_;                // per logits row: the batch row it comes from
  // activations
  std::vector<float> x_, xn_, q_, k_, v_, att_, gate_, up_;
  std::vector<float> logits_;  // [logit rows, vocab]
};

}  // namespace loom
