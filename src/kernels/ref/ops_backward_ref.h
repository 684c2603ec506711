// Scalar double-precision forwards and backwards of the training operators
// (kernels/cpu/ops_backward.h, linear_backward.h, loss.h). Everything is double so
// that finite differences of the forwards check the backwards to ~1e-8; the fast
// f32 kernels are then tested against these. Same gradient semantics as the fast
// versions (+= unless stated otherwise).
#pragma once

#include <cstdint>

#include "kernels/shapes.h"

namespace loom::ref {

void rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int64_t T, int64_t n,
                     double eps);
// dx +=, dw += (nullptr: frozen)
void rmsnorm_backward(double* dx, double* dw, const double* dout, const double* x, const double* w,
                      const double* rstd, int64_t T, int64_t n);

// In place, like rope_apply / rope_backward.
void rope_forward(const RopeTable& rope, double* x, int64_t T, int64_t n_heads, const int32_t* pos);
void rope_backward(const RopeTable& rope, double* d, int64_t T, int64_t n_heads, const int32_t* pos);

void swiglu_forward(double* out, const double* gate, const double* up, int64_t n);
// dgate, dup overwritten
void swiglu_backward(double* dgate, double* dup, const double* dout, const double* gate, const double* up,
                     int64_t n);

// Packed causal GQA self-attention, seq_start = row index of each row's sample start.
void attention_forward(double* out, double* lse, const double* q, const double* k, const double* v,
                       const AttentionShape& s, int64_t T, const int32_t* seq_start);
// dq +=, dk +=, dv += (materialises each row's probabilities; no use of out/lse).
void attention_backward(double* dq, double* dk, double* dv, const double* dout, const double* q, const double* k,
                        const double* v, const AttentionShape& s, int64_t T, const int32_t* seq_start);

// dW [vocab, H] +=
void embedding_backward(double* dW, const double* dout, const int32_t* tokens, int64_t T, int64_t H);

// y [T, N] = x [T, K] W^T (+ b)   (b may be nullptr)
void linear_forward(double* y, const double* x, const double* W, const double* b, int64_t T, int64_t N, int64_t K);
// dx +=, dW +=, db += ; any of them may be nullptr
void linear_backward(double* dx, double* dW, double* db, const double* dy, const double* x, const double* W,
                     int64_t T, int64_t N, int64_t K);

// Cross-entropy of logits = h W^T [T, V] against labels (-100 = ignored row).
// Returns the summed loss over unmasked rows; *count gets their number and
// *correct (if given) those whose largest logit is the label's, ties going to
// the lowest index (torch.argmax).
// dh +=, dW += (each may be nullptr) of grad_scale * summed loss.
double cross_entropy(double* dh, double* dW, int64_t* count, const double* h, const double* W,
                     const int32_t* labels, int64_t T, int64_t V, int64_t H, double grad_scale,
                     int64_t* correct = nullptr);

}  // namespace loom::ref
