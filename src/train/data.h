// Fine-tuning data: JSONL datasets (text, prompt/completion, chat messages,
// Alpaca) tokenized once into ids + loss labels, cached on disk, packed into
// rows of seq_len and served as shuffled micro-batches with a resumable cursor.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace loom {

// Label of a token the loss ignores (Hugging Face's ignore_index).
inline constexpr int32_t kIgnoreLabel = -100;

// The JSONL record shapes. `auto_detect` decides per line from the keys, in this
// order: "messages"; "prompt"/"completion"; "instruction"/"output" (Alpaca); "text".
enum class DataFormat { auto_detect, text, prompt_completion, messages, alpaca };
const char* data_format_name(DataFormat f);
std::optional<DataFormat> data_format_from_name(std::string_view name);  // "auto", "text", ...

// Alpaca records become prompt/completion with the Stanford Alpaca prompt text:
//   "Below is an instruction that describes a task[, paired with an input that provides
//   further context]. Write a response that appropriately completes the request.\n\n"
//   "### Instruction:\n{instruction}\n\n[### Input:\n{input}\n\n]### Response:\n"
// (the bracketed parts only when "input" is present and non-empty); "output" is the completion.
std::string alpaca_prompt(std::string_view instruction, std::string_view input);

struct DataOptions {
  DataFormat format = DataFormat::auto_detect;
  int64_t seq_len = 2048;  // row length; longer samples are truncated (and counted)
  bool pack = true;        // several samples per row; false: one sample per row
  // Train on prompt / user / system tokens too (default: only completions and
  // assistant replies, with their end-of-turn token).
  bool train_on_prompt = false;
  bool skip_bad_lines = false;  // count and skip malformed lines instead of failing
  // Read special-token text ("<|im_end|>") in text/prompt/completion fields as the
  // special token, as Hugging Face tokenizers do by default. Chat messages always do
  // (the rendered template relies on it).
  bool parse_special = true;
  bool shuffle = true;
  uint64_t seed = 0;
  // Eval split taken from the training file (seeded), unless eval_file is set:
  // eval_count samples if > 0, else round(eval_fraction * samples).
  double eval_fraction = 0;
  int64_t eval_count = 0;
  std::string eval_file;
  std::string cache_dir;  // empty: tokenize every time, no cache
  // A valid cache file is used, but none is written (`loom train --check` writes nothing).
  bool cache_read_only = false;
};

// What reading a file found; the trainer prints it. Nothing is dropped silently.
struct DataStats {
  int64_t lines = 0;        // lines in the file, blank ones included
  int64_t blank_lines = 0;  // empty or white-space lines (ignored)
  int64_t samples = 0;      // samples kept
  int64_t skipped = 0;      // malformed lines skipped (skip_bad_lines)
  int64_t truncated = 0;    // samples cut to seq_len
  int64_t dropped = 0;      // samples with no token to learn (e.g. truncated inside the prompt)
  int64_t tokens = 0;       // tokens of the kept samples
  int64_t masked_tokens = 0;  // of which label == kIgnoreLabel
  std::vector<std::string> skipped_examples;  // messages of the first few skipped lines
};
// One line for logs: "12 samples from 14 lines (1 blank, 1 skipped, ...), 345 tokens (120 masked)".
std::string format_data_stats(const DataStats& s);

// Tokenized samples, stored flat. labels[i] is ids[i] where the loss applies,
// else kIgnoreLabel (Hugging Face convention, not shifted); the first label of
// every sample is kIgnoreLabel since no token predicts it.
struct SampleSet {
  std::vector<int64_t> offsets{0};  // sample i is [offsets[i], offsets[i + 1])
  std::vector<int32_t> ids, labels;

  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t length(int64_t i) const { return offsets[i + 1] - offsets[i]; }
  std::span<const int32_t> ids_of(int64_t i) const;
  std::span<const int32_t> labels_of(int64_t i) const;
  void add(std::span<const int32_t> sample_ids, std::span<const int32_t> sample_labels);
};

struct TokenizedSample {
  std::vector<int32_t> ids, labels;
};

// One JSON record -> ids + labels (not truncated). `tmpl` is needed for
// "messages" records. Throws invalid_input saying what is wrong with the record
// (no location: callers prefix "file:line").
//  - text: [BOS if the tokenizer adds one] text EOS, all trained;
//  - prompt/completion, Alpaca: [BOS] prompt completion EOS, the prompt masked;
//  - messages: the rendered conversation (it holds any BOS), trained on each
//    assistant reply up to and including its end-of-turn token.
// ids always equal tokenizing the whole text at once; a token straddling the
// prompt/reply border counts as reply.
TokenizedSample tokenize_record(const nlohmann::json& record, const Tokenizer& tok, const ChatTemplate* tmpl,
                                const DataOptions& opt);

// Reads a JSONL file (or its text: `path` then only names it in messages) into
// samples truncated to opt.seq_len, filling `stats`. A bad line throws
// invalid_input "path:line: ..." unless opt.skip_bad_lines; an empty file or one
// without samples throws too.
SampleSet read_jsonl_dataset(const std::string& path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt, DataStats& stats);
SampleSet read_jsonl_text(std::string_view text, const std::string& path, const Tokenizer& tok,
                          const ChatTemplate* tmpl, const DataOptions& opt, DataStats& stats);

// ---- cache -----------------------------------------------------------------

// A hash of everything that decides how text becomes ids: vocabulary, merges,
// added tokens, normalizer / pre-tokenizer steps, BOS/EOS settings (not the
// file name the tokenizer came from).
uint64_t tokenizer_fingerprint(const Tokenizer& tok);

struct CacheInfo {
  enum class Status { disabled, hit, built, rebuilt } status = Status::disabled;
  std::string path;    // the cache file
  std::string reason;  // rebuilt: why the old file was not used; also a failed write
};
const char* cache_status_name(CacheInfo::Status s);

// Cache file name for `file_bytes` read with these settings: the key hashes the
// file bytes, tokenizer, chat template and every option that changes samples.
std::string dataset_cache_path(const std::string& cache_dir, std::string_view file_bytes, const Tokenizer& tok,
                               const ChatTemplate* tmpl, const DataOptions& opt);

// read_jsonl_dataset through the cache in opt.cache_dir: a valid cache file is
// used as is (stats included); a missing, corrupt or mismatched one is ignored,
// rebuilt and rewritten (atomically; not with opt.cache_read_only). Never
// trusts a file that fails a check.
SampleSet load_jsonl_dataset(const std::string& path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt, DataStats& stats, CacheInfo& cache);

// ---- packing and batches ---------------------------------------------------

// Rows of seq_len tokens, each a run of whole samples (one when not packing).
struct PackedRows {
  int64_t seq_len = 0;
  std::vector<int64_t> samples;           // sample indices in row order
  std::vector<int64_t> row_offsets{0};    // row r holds samples[row_offsets[r] .. row_offsets[r + 1])
  int64_t rows() const { return static_cast<int64_t>(row_offsets.size()) - 1; }
};
// Packs `order` (sample indices, each at most seq_len long) greedily in order.
PackedRows pack_samples(const SampleSet& set, std::span<const int64_t> order, int64_t seq_len, bool pack);

// A permutation of [0, n) that depends only on (seed, stream): Fisher-Yates on
// CounterRng draws.
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t stream);

struct DataSplit {
  std::shared_ptr<const SampleSet> samples;
  PackedRows rows;
  DataStats stats;  // of the file the samples came from (the train file for a split-off eval set)
  int64_t n_samples = 0;  // samples in this split
};

struct TrainData {
  DataSplit train;
  std::optional<DataSplit> eval;
  CacheInfo train_cache, eval_cache;
  int32_t pad_id = 0;  // token written after the last sample of a row (masked)
};

// The whole pipeline: load (cached) train file, take the eval split or read the
// eval file, shuffle (seeded) and pack. Throws invalid_input for bad options
// (seq_len < 2, an eval split leaving no training sample, ...).
TrainData prepare_train_data(const std::string& train_path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt);

// A micro-batch, row-major [rows, seq_len]. The loss at position t compares the
// logits of t with targets[t]; attention from t sees only [seq_start[t], t].
struct Batch {
  int64_t rows = 0, seq_len = 0;
  std::vector<int32_t> tokens;     // padding: TrainData::pad_id
  std::vector<int32_t> targets;    // the next token's label within the same sample, else kIgnoreLabel
  std::vector<int32_t> positions;  // restart at 0 for every sample; 0 on padding
  std::vector<int32_t> seq_start;  // row index where t's sample starts; t itself on padding
  int64_t target_tokens = 0;       // targets != kIgnoreLabel: the loss denominator
  size_t capacity_bytes() const;   // what the vectors hold allocated
};

// Fills a batch with the given rows of `split`.
void fill_batch(const DataSplit& split, std::span<const int64_t> row_ids, int32_t pad_id, Batch& out);

// Where a DataLoader stands: the next batch starts at row `index` of epoch
// `epoch`'s order. Two integers: store them in a checkpoint to resume exactly.
struct DataCursor {
  int64_t epoch = 0;
  int64_t index = 0;
  bool operator==(const DataCursor&) const = default;
};

// Endless micro-batches over a split, epoch after epoch. Row order is a seeded
// permutation per epoch (identity without shuffle); the last batch of an epoch
// may have fewer rows. Batch contents depend only on (seed, cursor). Keeps a
// reference to `split`, which must outlive it.
class DataLoader {
 public:
  DataLoader(const DataSplit& split, int32_t pad_id, int64_t batch_rows, bool shuffle, uint64_t seed,
             DataCursor start = {});
  Batch next();
  // The same into `out`, reusing its vectors (sized once for batch_rows() full
  // rows): the steady-state step allocates nothing.
  void next(Batch& out);
  // Moves past the batch next() would give, without filling it (data
  // parallel: the micro-batches of the other ranks).
  void skip();
  DataCursor cursor() const { return cursor_; }
  void seek(DataCursor c);  // throws invalid_input for a cursor outside the data
  int64_t batches_per_epoch() const;
  int64_t batch_rows() const { return batch_rows_; }

 private:
  void load_order();

  const DataSplit& split_;
  int32_t pad_id_;
  int64_t batch_rows_;
  bool shuffle_;
  uint64_t seed_;
  DataCursor cursor_;
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;
};

}  // namespace loom
