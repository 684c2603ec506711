// Batched forward step over the paged KV cache (see batch_forward.h): the
// decoder layer of model/decoder.h with paged attention and per-row LoRA.
// Buffers are sized at construction (the logits and LoRA buffers grow only past
// their largest use), so a step does not allocate after warm-up.
#include "serve/batch_forward.h"

#include <algorithm>
#include <functional>

#include "core/cpu_features.h"
#include "core/error.h"
#include "dist/partial_sums.h"
#include "serve/tp_adapters.h"
#include "serve/tp_link.h"

namespace loom {

namespace {

template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

// K/V projections land in the step's k/v rows, which after RoPE go into each
// sequence's blocks; attention reads every row's sequence through its block table.
class BatchForward::PagedAttention final : public AttentionStep {
 public:
  explicit PagedAttention(BatchForward& f) : f_(f) {}
  float* keys(int64_t) override { return f_.acts_.k; }
  float* values(int64_t) override { return f_.acts_.v; }
  void attend(int64_t layer, const float* q, const float* k, const float* v, float* att) override {
    Backend& be = f_.dec_.backend();
    KvPool& kv = f_.kv_;
    const AttentionShape shape = f_.dec_.attention_shape();
    be.paged_store(shape, kv.keys(layer), kv.values(layer), kv.dtype(), kv.block_size(), k, v, f_.kv_slot_.data(),
                   f_.T_);
    const PagedKvView view{kv.keys(layer), kv.values(layer), kv.block_size(), kv.dtype()};
    be.paged_attention(shape, view, q, att, f_.T_, f_.pos_.data(), f_.tables_.data());
  }

 private:
  BatchForward& f_;
};

// Each row's own adapter (or none) on the linear outputs, as one backend
// lora_rows op per adaptation point. A pair kept in 4 bits (int8, bf16) is passed
// as its codes: the kernel reads them in place (the values it computes with are those
// unpack_int4_rows gives, so a row's result does not depend on the others).
class BatchForward::RowAdapters final : public LayerAdapters {
 public:
  explicit RowAdapters(BatchForward& f) : f_(f) {}
  void apply(int64_t layer, std::span<const AdapterJob> jobs) override {
    LOOM_ASSERT(jobs.size() <= 3);
    const std::vector<int32_t>& rows = f_.lora_rows_;
    const size_t NR = rows.size();
    factors_.resize(3 * NR);
    pointers_.resize(3 * NR);
    LoraRowsJob out[3];
    for (size_t j = 0; j < jobs.size(); ++j) {
      const AdapterJob& job = jobs[j];
      for (size_t i = 0; i < NR; ++i) {
        const ServeAdapter* a = f_.row_adapter_[static_cast<size_t>(rows[i])];
        if (i > 0 && a == f_.row_adapter_[static_cast<size_t>(rows[i - 1])]) {  // one factor for a run of rows
          pointers_[j * NR + i] = pointers_[j * NR + i - 1];
          continue;
        }
        const ServeLoraPair& p = a->pair(layer, job.target);
        if (p.present()) factors_[j * NR + i] = factor_of(p, a->scale);
        pointers_[j * NR + i] = p.present() ? &factors_[j * NR + i] : nullptr;
      }
      out[j] = {job.x, job.ldx, job.y, job.ldy, lora_target_out(f_.c_, job.target), pointers_.data() + j * NR};
      out[j].stream_factors = f_.lora_cold_;
    }
    f_.dec_.backend().lora_rows(*f_.ws_, std::span<const LoraRowsJob>(out, jobs.size()), rows, f_.lora_rank_,
                                f_.lora_u_.data(), f_.T_);
  }

 private:
  static LoraFactor factor_of(const ServeLoraPair& p, float scale) {
    LoraFactor f;
    f.a = p.a.as<const float>();  // null when kept in 4 bits
    f.b = p.b.as<const float>();
    f.rank = p.rank();
    f.in = p.a.dim(1);
    f.out = p.b.dim(0);
    f.scale = scale;
    f.a4 = p.a4;
    f.b4 = p.b4;
    f.a16 = p.a16;
    f.b16 = p.b16;
    f.a8 = p.a8;
    f.b8 = p.b8;
    return f;
  }

  BatchForward& f_;
  std::vector<LoraFactor> factors_;
  std::vector<const LoraFactor*> pointers_;
};

BatchForward::BatchForward(const ModelConfig& config, const ModelWeights& weights, Backend& backend, KvPool& kv,
                           int64_t max_batch_tokens, int64_t max_logit_rows)
    : c_(config),
      dec_(config, weights, backend),
      kv_(kv),
      max_tokens_(max_batch_tokens),
      ws_(backend.make_workspace()),
      attention_(std::make_unique<PagedAttention>(*this)),
      adapters_(std::make_unique<RowAdapters>(*this)),
      acts_(config, backend, max_batch_tokens, /*kv_rows=*/true) {
  llc_bytes_ = last_level_cache_bytes();
  weight_bytes_ = decode_matrix_bytes(weights);
  LOOM_ASSERT(max_batch_tokens > 0 && max_logit_rows > 0);
  LOOM_ASSERT(kv.n_layers() == config.n_layers && kv.n_kv_heads() == config.n_kv_heads &&
              kv.head_dim() == config.head_dim);
  const auto mt = static_cast<size_t>(max_batch_tokens);
  tokens_.reserve(mt);
  pos_.resize(mt);
  kv_slot_.resize(mt);
  tables_.resize(mt);
  row_adapter_.resize(mt);
  lora_rows_.reserve(mt);
  logit_src_.reserve(mt);
  logits_.resize(static_cast<size_t>(std::min(max_logit_rows, max_batch_tokens) * c_.vocab_size));
}

BatchForward::~BatchForward() = default;

const float* BatchForward::logits(size_t chunk) const {
  LOOM_ASSERT(chunk < logit_row_.size());
  const int64_t i = logit_row_[chunk];
  return i < 0 ? nullptr : logits_.data() + i * c_.vocab_size;
}

const float* BatchForward::hidden(size_t chunk) const {
  LOOM_ASSERT(chunk < hidden_row_.size());
  const int64_t i = hidden_row_[chunk];
  return i < 0 ? nullptr : hidden_.data() + i * c_.hidden;
}

// Per-row bookkeeping of a step: tokens, positions, KV rows, adapters, logits rows.
void BatchForward::prepare(std::span<const BatchChunk> chunks) {
  int64_t T = 0;
  for (const BatchChunk& ch : chunks) {
    LOOM_ASSERT(ch.table != nullptr && !ch.tokens.empty() && ch.n_past >= 0);
    dec_.check_tokens(ch.tokens);
    T += static_cast<int64_t>(ch.tokens.size());
  }
  LOOM_ASSERT(T <= max_tokens_);
  T_ = T;

  const int64_t bs = kv_.block_size();
  tokens_.clear();
  logit_row_.assign(chunks.size(), -1);
  logit_src_.clear();
  hidden_row_.assign(chunks.size(), -1);
  hidden_src_.clear();
  lora_rows_.clear();
  lora_rank_ = 0;
  size_t lora_bytes = 0;
  int64_t r = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const BatchChunk& ch = chunks[ci];
    const int64_t n = static_cast<int64_t>(ch.tokens.size()), end = ch.n_past + n;
    const BlockTable& tb = *ch.table;
    LOOM_ASSERT(end <= tb.n_blocks() * bs);
    // The blocks written must belong to this sequence alone (never a shared prefix block).
    // (A tensor-parallel follower's pool is not allocated from: rank 0's is.)
    for (int64_t b = ch.n_past / bs; b < (end + bs - 1) / bs && !following_; ++b)
      LOOM_ASSERT(kv_.ref_count(tb.blocks[static_cast<size_t>(b)]) == 1);
    if (ch.adapter != nullptr) {
      LOOM_ASSERT(ch.adapter->pairs.size() == static_cast<size_t>(c_.n_layers * kLoraTargetCount));
      if (ci == 0 || chunks[ci - 1].adapter != ch.adapter) {
        lora_rank_ = std::max(lora_rank_, ch.adapter->max_rank());
        lora_bytes += ch.adapter->factor_bytes();  // an adapter in two runs counts twice: a bound
      }
    }
    tokens_.insert(tokens_.end(), ch.tokens.begin(), ch.tokens.end());
    for (int64_t i = 0; i < n; ++i, ++r) {
      const auto ur = static_cast<size_t>(r);
      const int64_t p = ch.n_past + i;
      pos_[ur] = static_cast<int32_t>(p);
      kv_slot_[ur] = kv_.slot_of(tb, p);
      tables_[ur] = tb.blocks.data();
      row_adapter_[ur] = ch.adapter;
      if (ch.adapter != nullptr) lora_rows_.push_back(static_cast<int32_t>(r));
    }
    if (ch.want_logits) {
      LOOM_ASSERT(ch.logit_rows >= 1 && ch.logit_rows <= n);
      logit_row_[ci] = static_cast<int64_t>(logit_src_.size());
      for (int64_t i = r - ch.logit_rows; i < r; ++i) logit_src_.push_back(i);
    }
    if (ch.want_hidden) {
      hidden_row_[ci] = static_cast<int64_t>(hidden_src_.size());
      for (int64_t i = r - n; i < r; ++i) hidden_src_.push_back(i);
    }
  }
  // Rows of one adapter next to each other: the LoRA passes then walk each
  // adapter's A and B once per run of rows (from cache) instead of once per row
  // (a 256-row prefill chunk read ~2 GB of adapter weights otherwise). Order
  // only decides which thread computes a row; each row's result is unchanged.
  std::sort(lora_rows_.begin(), lora_rows_.end(), [&](int32_t a, int32_t b) {
    const ServeAdapter* pa = row_adapter_[static_cast<size_t>(a)];
    const ServeAdapter* pb = row_adapter_[static_cast<size_t>(b)];
    return pa != pb ? std::less<const ServeAdapter*>()(pa, pb) : a < b;
  });
  lora_cold_ = llc_bytes_ == 0 || weight_bytes_ + lora_bytes > llc_bytes_;
  grow(lora_u_, static_cast<size_t>(3 * T * lora_rank_));
  grow(logits_, logit_src_.size() * static_cast<size_t>(c_.vocab_size));
  grow(hidden_, hidden_src_.size() * static_cast<size_t>(c_.hidden));
}

void BatchForward::step(std::span<const BatchChunk> chunks) {
  if (chunks.empty()) {
    logit_row_.clear();
    return;
  }
  prepare(chunks);  // a bad token throws here, before anything is sent or written
  if (tp_ != nullptr) send_step(chunks);
  run_step();
}

void BatchForward::run_step() {
  const int64_t T = T_;
  dec_.embed(tokens_.data(), T, acts_.x);
  dec_.rope_table(pos_.data(), T, acts_.rope_cs);
  const LayerBuffers b = acts_.layer();
  LayerAdapters* adapters = lora_rows_.empty() ? nullptr : adapters_.get();
  for (int64_t l = 0; l < c_.n_layers; ++l) dec_.layer(*ws_, l, T, b, acts_.rope_cs, *attention_, adapters);

  // Embedding rows: the final norm alone, row by row (batch invariant like every op).
  if (!hidden_src_.empty())
    dec_.final_norm(acts_.x, hidden_src_.data(), static_cast<int64_t>(hidden_src_.size()), hidden_.data());
  // Only the rows whose logits are wanted pass the final norm and the output projection.
  const auto n_out = static_cast<int64_t>(logit_src_.size());
  if (n_out == 0) return;
  dec_.final_norm(acts_.x, logit_src_.data(), n_out, acts_.xn);
  dec_.logits(*ws_, acts_.xn, n_out, logits_.data());
}

// ---- tensor parallel -------------------------------------------------------
// A step as rank 0 sends it (a TpMessage::step): [chunks, then per chunk n_past,
// tokens, blocks, want_logits, adapter id (0: none)], the tokens, the block ids.

void BatchForward::set_tensor_parallel(Communicator* comm) {
  tp_ = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  sums_ = tp_ ? std::make_unique<CommunicatorSums>(*tp_) : nullptr;
  dec_.set_partial_sums(sums_.get());
}

void BatchForward::send_step(std::span<const BatchChunk> chunks) {
  if (tp_->rank() != 0) return;  // a follower's step came from rank 0
  std::vector<int64_t> msg = {static_cast<int64_t>(chunks.size())};
  for (const BatchChunk& c : chunks) {
    LOOM_ASSERT((c.adapter == nullptr) == (c.adapter_id == 0));
    msg.insert(msg.end(), {c.n_past, static_cast<int64_t>(c.tokens.size()), c.table->n_blocks(),
                           c.want_logits ? 1 : 0, c.adapter_id});
  }
  for (const BatchChunk& c : chunks) msg.insert(msg.end(), c.tokens.begin(), c.tokens.end());
  for (const BatchChunk& c : chunks) msg.insert(msg.end(), c.table->blocks.begin(), c.table->blocks.end());
  tp_send(*tp_, TpMessage::step, msg);
}

void BatchForward::stop_followers() {
  if (tp_ == nullptr || tp_->rank() != 0) return;
  tp_send(*tp_, TpMessage::stop, {});
}

void BatchForward::follow(TpAdapterReceiver& adapters) {
  LOOM_ASSERT(tp_ != nullptr && tp_->rank() != 0);
  following_ = true;
  std::vector<int64_t> msg;
  for (;;) {
    switch (tp_receive(*tp_, msg)) {
      case TpMessage::stop:
        return;
      case TpMessage::step:
        follow_step(msg, adapters);
        break;
      case TpMessage::adapter_load:
        adapters.load(msg);
        break;
      case TpMessage::adapter_drop:
        LOOM_ASSERT(msg.size() == 1);
        adapters.drop(msg[0]);
        break;
    }
  }
}

void BatchForward::follow_step(std::span<const int64_t> msg, const TpAdapterReceiver& adapters) {
  constexpr size_t kHead = 5;  // values per chunk before the tokens
  const auto k = static_cast<size_t>(msg[0]);
  std::vector<BlockTable> tables(k);
  std::vector<std::vector<int32_t>> tokens(k);
  std::vector<BatchChunk> chunks(k);
  const auto part = [&](size_t at, int64_t n) {
    return std::pair(msg.begin() + static_cast<std::ptrdiff_t>(at),
                     msg.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(n)));
  };
  size_t at = 1 + kHead * k;
  for (size_t i = 0; i < k; ++i) {  // tokens first, then the block ids, chunk by chunk
    const auto [b, e] = part(at, msg[1 + kHead * i + 1]);
    tokens[i].assign(b, e);
    at += tokens[i].size();
  }
  for (size_t i = 0; i < k; ++i) {
    const int64_t* h = msg.data() + 1 + kHead * i;
    const auto [b, e] = part(at, h[2]);
    tables[i].blocks.assign(b, e);
    at += tables[i].blocks.size();
    chunks[i].table = &tables[i];
    chunks[i].n_past = h[0];
    chunks[i].tokens = tokens[i];
    chunks[i].want_logits = false;  // rank 0 samples: the logits are its alone
    chunks[i].adapter_id = h[4];
    chunks[i].adapter = h[4] != 0 ? &adapters.get(h[4]) : nullptr;
  }
  step(chunks);
}

}  // namespace loom
