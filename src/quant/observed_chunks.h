// The calibration loop imatrix and activation statistics share: a text in
// chunks of n_ctx tokens, each evaluated from an empty cache (its first token
// replaced by BOS when the tokenizer adds one, as llama.cpp's tools do), with
// an observer on every layer's linear inputs (InferenceSession::set_layer_hook).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "model/forward.h"

namespace loom {

// Runs chunks [0, n_chunks) of `tokens` through `session` with `observer`
// hooked in (and unhooked again, also when a chunk throws); on_chunk(c, n)
// after chunk c (1-based). The caller has checked that n_chunks * n_ctx
// tokens exist and that a chunk fits the session.
void run_observed_chunks(InferenceSession& session, std::span<const int32_t> tokens, int64_t n_ctx, int64_t n_chunks,
                         int32_t bos, LayerAdapters& observer, const std::function<void(int64_t, int64_t)>& on_chunk);

}  // namespace loom
