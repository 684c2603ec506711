#include "kernels/ref/lora_rows_ref.h"

#include <cmath>
#include <vector>

#include "core/half.h"
#include "kernels/int_quant.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"

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

namespace {

// An int8 factor (kernels/lora_i8.h) on its codes: u[j] = (lora_dot(x, A's codes
// of row j) * A's scale of row j) * scale; for column n in block q, with ub[j] =
// u[j] * B's scale of (q, j): y[n] += lora_dot(ub, B's codes of column n).
void add_int8(const LoraFactor& f, const float* x, float* y) {
  const int64_t r = f.rank;
  std::vector<float> codes(static_cast<size_t>(f.in)), u(static_cast<size_t>(r)), ub(static_cast<size_t>(r));
  const int8_t* ca = lora_a8_codes(f.a8, r);
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t i = 0; i < f.in; ++i) codes[static_cast<size_t>(i)] = static_cast<float>(ca[j * f.in + i]);
    u[static_cast<size_t>(j)] = lora_dot(x, codes.data(), f.in) * lora_a8_scales(f.a8)[j] * f.scale;
  }
  codes.resize(static_cast<size_t>(r));
  for (int64_t n = 0; n < f.out; ++n) {
    const int64_t q = n / kLoraBlockCols, w = lora_b16_block_width(f.out, q);
    const int8_t* cb = lora_b8_codes(f.b8, f.out, r, q);
    for (int64_t j = 0; j < r; ++j) {
      ub[static_cast<size_t>(j)] = u[static_cast<size_t>(j)] * lora_b8_scales(f.b8, r, q)[j];
      codes[static_cast<size_t>(j)] = static_cast<float>(cb[j * w + n % kLoraBlockCols]);
    }
    y[n] += lora_dot(ub.data(), codes.data(), r);
  }
}

}  // namespace

void lora_rows(std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows) {
  std::vector<float> u, a4, b4;
  for (const LoraRowsJob& job : jobs)
    for (size_t k = 0; k < rows.size(); ++k) {
      const LoraFactor* f = job.factors[k];
      if (f == nullptr) continue;
      const float* a = f->a;
      const float* b = f->b;
      if (f->quantized()) {  // the values the codes stand for
        a4.resize(static_cast<size_t>(f->rank * f->in));
        b4.resize(static_cast<size_t>(f->out * f->rank));
        unpack_int4_rows(f->a4.codes, f->a4.scales, f->rank, f->in, f->a4.group, a4.data());
        unpack_int4_rows(f->b4.codes, f->b4.scales, f->out, f->rank, f->b4.group, b4.data());
        a = a4.data();
        b = b4.data();
      } else if (f->int8()) {
        add_int8(*f, job.x + rows[k] * job.ldx, job.y + rows[k] * job.ldy);
        continue;
      } else if (f->bf16()) {  // widened, exact
        a4.resize(static_cast<size_t>(f->rank * f->in));
        b4.resize(static_cast<size_t>(f->out * f->rank));
        for (size_t i = 0; i < a4.size(); ++i) a4[i] = bf16_to_fp32(f->a16[i]);
        for (int64_t n = 0; n < f->out; ++n)
          for (int64_t j = 0; j < f->rank; ++j)
            b4[static_cast<size_t>(n * f->rank + j)] =
                bf16_to_fp32(f->b16[lora_b16_index(f->out, f->rank, n, j)]);
        a = a4.data();
        b = b4.data();
      }
      const float* x = job.x + rows[k] * job.ldx;
      float* y = job.y + rows[k] * job.ldy;
      u.resize(static_cast<size_t>(f->rank));
      for (int64_t j = 0; j < f->rank; ++j) u[static_cast<size_t>(j)] = lora_dot(x, a + j * f->in, f->in) * f->scale;
      for (int64_t n = 0; n < f->out; ++n) y[n] += lora_dot(u.data(), b + n * f->rank, f->rank);
    }
}

}  // namespace loom::ref
