#include "kernels/ref/lora_rows_ref.h"

#include <cmath>
#include <vector>

namespace loom::ref {

float lora_dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {};
  const int64_t n8 = n / 8 * 8;
  for (int64_t c = 0; c < n8; c += 8)
    for (int l = 0; l < 8; ++l) lane[l] = std::fma(a[c + l], b[c + l], lane[l]);
  float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (int64_t c = n8; c < n; ++c) s = std::fma(a[c], b[c], s);
  return s;
}

void lora_rows(std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows) {
  std::vector<float> u;
  for (const LoraRowsJob& job : jobs)
    for (size_t k = 0; k < rows.size(); ++k) {
      const LoraFactor* f = job.factors[k];
      if (f == nullptr) continue;
      const float* x = job.x + rows[k] * job.ldx;
      float* y = job.y + rows[k] * job.ldy;
      u.resize(static_cast<size_t>(f->rank));
      for (int64_t j = 0; j < f->rank; ++j) u[static_cast<size_t>(j)] = lora_dot(x, f->a + j * f->in, f->in) * f->scale;
      for (int64_t n = 0; n < f->out; ++n) y[n] += lora_dot(u.data(), f->b + n * f->rank, f->rank);
    }
}

}  // namespace loom::ref
