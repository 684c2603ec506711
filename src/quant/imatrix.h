// Importance matrices, as llama.cpp's llama-imatrix computes and stores them:
// for every linear layer weight "blk.N.<name>.weight", the sum over a
// calibration text's tokens of each input column's squared activation, and
// the number of tokens. llama-quantize (and `loom quantize --imatrix`) weight
// each column's rounding error by sum / count when it searches block scales.
//
// Files: the GGUF form llama-imatrix writes by default ("<name>.in_sum2" and
// "<name>.counts" f32 tensors, general.type = imatrix, imatrix.datasets,
// imatrix.chunk_count, imatrix.chunk_size), which loom writes too, and the
// legacy .dat form, which loom reads.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "model/forward.h"

namespace loom {

struct Imatrix {
  struct Entry {
    std::vector<float> sums;       // per input column (times experts; loom's models have one)
    std::vector<int64_t> counts;   // tokens seen, one per expert matrix
  };
  std::map<std::string, Entry> entries;  // by weight name, e.g. "blk.0.attn_q.weight"
  std::vector<std::string> datasets;
  int64_t chunk_count = 0, chunk_size = 0;
  bool legacy = false;

  // llama-quantize's importance of each column: sums / count (a never-seen
  // matrix gets 1); for legacy files sums / ncall.
  std::map<std::string, std::vector<float>> importance() const;
  // Some entry saw a token (a file collected over 0 chunks holds none: quantizing
  // with it would be quantizing with no imatrix, which the grid types refuse).
  bool has_data() const;
};

// Reads a GGUF or legacy imatrix file. Throws invalid_input naming the file
// and entry for a malformed one, not_found when it does not exist.
Imatrix load_imatrix(const std::string& path);
// Writes the GGUF form, atomically.
void save_imatrix(const Imatrix& m, const std::string& path);

struct ImatrixOptions {
  int64_t n_ctx = 512;      // tokens per chunk
  int64_t max_chunks = -1;  // -1: all
  int32_t bos = -1;         // >= 0: the first token of every chunk becomes this
};

// Runs `tokens` through `session` chunk by chunk (every token of a chunk is
// collected) and accumulates the squared inputs of every layer's seven linear
// weights. Calls on_chunk(i, n) after each chunk. Throws invalid_input when
// the text has fewer than 2 * n_ctx tokens, as llama-imatrix refuses it.
Imatrix compute_imatrix(InferenceSession& session, const ModelConfig& config, std::span<const int32_t> tokens,
                        const ImatrixOptions& opt, const std::function<void(int64_t, int64_t)>& on_chunk);

}  // namespace loom
