// Reductions over one row of logits on the host, for sampling and for the
// log-probabilities a server returns: a whole vocabulary (SmolLM2's 49,152)
// per generated token, where scalar loops cost more than the step's sampling
// should (`loom_bench --benchmark_filter='Greedy|Logprobs'`).
#pragma once

#include <cstdint>

namespace loom {

// The first index of the largest of x[0, n) (std::max_element's answer; NaN is
// never the largest), 0 when none is larger than -inf. Lanes that each keep
// their first maximum, merged by value then index (Zen 5: 1.9 us a row against
// std::max_element's 27).
int64_t argmax_first(const float* x, int64_t n);

// log(sum_i exp(x_i)) over x[0, n) (n >= 1): the largest (NaN skipped)
// subtracted first, the exponentials taken 8 lanes at a time (simd::exp_ps, a
// few ulp) and summed in double. -inf when every x_i is -inf.
double logsumexp(const float* x, int64_t n);

// out[0, k) = the indices of the k largest of x[0, n) (k <= n), largest first,
// equal values by lower index (a stable descending sort's first k); NaN ranks
// below every number. One pass: a value enters only above the k-th kept.
void top_k(const float* x, int64_t n, int64_t k, int32_t* out);

}  // namespace loom
