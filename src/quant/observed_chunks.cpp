#include "quant/observed_chunks.h"

#include <vector>

namespace loom {

void run_observed_chunks(InferenceSession& session, std::span<const int32_t> tokens, int64_t n_ctx, int64_t n_chunks,
                         int32_t bos, LayerAdapters& observer, const std::function<void(int64_t, int64_t)>& on_chunk) {
  session.set_layer_hook(&observer);
  std::vector<int32_t> chunk;
  try {
    for (int64_t c = 0; c < n_chunks; ++c) {
      chunk.assign(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx);
      if (bos >= 0) chunk[0] = bos;
      session.truncate(0);
      session.eval(chunk);
      if (on_chunk) on_chunk(c + 1, n_chunks);
    }
  } catch (...) {
    session.set_layer_hook(nullptr);
    throw;
  }
  session.set_layer_hook(nullptr);
}

}  // namespace loom
