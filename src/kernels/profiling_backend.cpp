#include "kernels/profiling_backend.h"

#include <algorithm>
#include <type_traits>
#include <utility>

namespace loom {
namespace {

// What an op is, for its span: rows, a product's shape and weight type, the
// FLOPs and the bytes it must move at least (weights once, activations in and out).
struct OpInfo {
  int64_t T = -1, N = -1, K = -1;
  const char* dtype = nullptr;
  double flops = 0, bytes = 0;
};

double f32_bytes(double n) { return 4.0 * n; }

// y [T, N] = x [T, K] W^T with W of `w_bytes`.
OpInfo product(int64_t T, int64_t N, int64_t K, DType dtype, size_t w_bytes) {
  const double t = static_cast<double>(T), n = static_cast<double>(N), k = static_cast<double>(K);
  return {T, N, K, dtype_name(dtype), 2.0 * t * n * k, static_cast<double>(w_bytes) + f32_bytes(t * (n + k))};
}

// Attention's products over `context` (query, key) pairs: QK^T and PV, 2 FLOPs
// per pair, head dimension and head each.
OpInfo attention_info(const AttentionShape& s, int64_t T, double context, double products) {
  OpInfo o;
  o.T = T;
  o.flops = products * static_cast<double>(s.n_heads * s.head_dim) * context;
  return o;
}

class ProfilingBackend final : public Backend {
 public:
  ProfilingBackend(std::unique_ptr<Backend> inner, Tracer& tracer, ThreadPool& pool)
      : in_(std::move(inner)), t_(tracer), pool_(pool) {}

  Tracer* tracer() override { return &t_; }
  Device device() const override { return in_->device(); }
  WorkspaceBytes workspace_bytes(const WorkspaceShape& s) const override { return in_->workspace_bytes(s); }
  void reserve_workspace(Workspace& ws, const WorkspaceShape& s) override { in_->reserve_workspace(ws, s); }
  DeviceBuffer alloc(size_t bytes) override { return in_->alloc(bytes); }
  std::unique_ptr<Workspace> make_workspace() override { return in_->make_workspace(); }
  WeightHandle prepare_weight(const Tensor& W, const char* name, WeightHandle recycle) override {
    return in_->prepare_weight(W, name, std::move(recycle));
  }
  WeightHandle prepare_transposed(const Tensor& W, BackwardPrecision p, const char* name, WeightHandle recycle,
                                  Workspace* ws) override {
    return run("prepare_transposed", product(0, W.rows(), W.cols(), W.dtype, W.nbytes()),
               [&] { return in_->prepare_transposed(W, p, name, std::move(recycle), ws); });
  }

  void matmul(Workspace& ws, const DeviceWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
              int64_t T) override {
    run("matmul", product(T, W.rows(), W.cols(), W.dtype(), W.nbytes()),
        [&] { in_->matmul(ws, W, x, ldx, y, ldy, T); });
  }
  void matmul_dense(Workspace& ws, const Tensor& W, const float* x, float* y, int64_t T) override {
    run("matmul_dense", product(T, W.rows(), W.cols(), W.dtype, W.nbytes()),
        [&] { in_->matmul_dense(ws, W, x, y, T); });
  }
  void matmul_multi(Workspace& ws, std::span<const MatmulTarget> outs, const float* x, int64_t ldx,
                    int64_t T) override {
    int64_t N = 0;
    size_t w_bytes = 0;
    for (const MatmulTarget& o : outs) N += o.W->rows(), w_bytes += o.W->nbytes();
    const OpInfo info = outs.empty() ? OpInfo{} : product(T, N, outs[0].W->cols(), outs[0].W->dtype(), w_bytes);
    run("matmul", info, [&] { in_->matmul_multi(ws, outs, x, ldx, T); });
  }
  void lora_rows(Workspace& ws, std::span<const LoraRowsJob> jobs, std::span<const int32_t> rows, int64_t max_rank,
                 float* u, int64_t T) override {
    OpInfo o;
    o.T = static_cast<int64_t>(rows.size());
    // bytes: each factor once per run of rows that share it (the server puts an
    // adapter's rows together, and the kernel reads its factors once for them),
    // an adapted row's x once per x the jobs share, its y in and out.
    const LoraRowsJob* last = nullptr;
    for (const LoraRowsJob& j : jobs) {
      const bool new_x = last == nullptr || last->x != j.x;
      last = &j;
      for (size_t r = 0; r < rows.size(); ++r) {
        const LoraFactor* f = j.factors[r];
        if (f == nullptr) continue;
        if (o.dtype == nullptr)
          o.dtype = f->bf16() ? "bf16" : f->int8() ? "int8" : f->quantized() ? "int4" : "f32";
        o.flops += 2.0 * static_cast<double>(f->rank * (f->in + f->out));
        if (r == 0 || j.factors[r - 1] != f) o.bytes += f->bytes();
        o.bytes += f32_bytes(static_cast<double>((new_x ? f->in : 0) + 2 * f->out));
      }
    }
    run("lora", o, [&] { in_->lora_rows(ws, jobs, rows, max_rank, u, T); });
  }
  void rmsnorm(float* out, float* rstd, const float* x, const float* w, int64_t T, int64_t n, float eps) override {
    run("rmsnorm", rows(T, 2.0 * static_cast<double>(T * n)), [&] { in_->rmsnorm(out, rstd, x, w, T, n, eps); });
  }
  void rope_table(const RopeTable& rope, const int32_t* pos, int64_t T, float* cs) override {
    run("rope_table", rows(T, 0), [&] { in_->rope_table(rope, pos, T, cs); });
  }
  void rope(const RopeTable& rope, const float* cs, float* x, int64_t T, int64_t n_heads, bool inverse) override {
    run("rope", rows(T, 0), [&] { in_->rope(rope, cs, x, T, n_heads, inverse); });
  }
  void swiglu(float* h, const float* gate, const float* up, int64_t T, int64_t F) override {
    run("swiglu", rows(T, 3.0 * static_cast<double>(T * F)), [&] { in_->swiglu(h, gate, up, T, F); });
  }
  void add(float* out, const float* a, const float* b, int64_t n) override {
    run("add", elements(n, 3), [&] { in_->add(out, a, b, n); });
  }
  void add_bias(float* y, const float* bias, int64_t T, int64_t n) override {
    run("add_bias", rows(T, 2.0 * static_cast<double>(T * n)), [&] { in_->add_bias(y, bias, T, n); });
  }
  void scale(float* x, float s, int64_t n) override { run("scale", elements(n, 2), [&] { in_->scale(x, s, n); }); }
  void round_to(DType to, float* dst, const float* src, int64_t n) override {
    run("round_to", elements(n, 2), [&] { in_->round_to(to, dst, src, n); });
  }
  void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t r, int64_t cols) override {
    run("copy", rows(r, 2.0 * static_cast<double>(r * cols)), [&] { in_->copy_2d(dst, ld_dst, src, ld_src, r, cols); });
  }
  void zero(float* x, int64_t n) override { run("zero", elements(n, 1), [&] { in_->zero(x, n); }); }
  void transpose(float* dst, const float* src, int64_t r, int64_t cols) override {
    run("transpose", elements(r * cols, 2), [&] { in_->transpose(dst, src, r, cols); });
  }
  void embedding(const Tensor& table, const int32_t* tokens, int64_t T, float* out) override {
    OpInfo o = rows(T, static_cast<double>(T * table.cols()));
    o.bytes += static_cast<double>(T) * static_cast<double>(table.row_bytes());
    o.dtype = dtype_name(table.dtype);
    run("embedding", o, [&] { in_->embedding(table, tokens, T, out); });
  }
  void dropout(float* dst, const float* src, int64_t n, double p, uint64_t seed, uint64_t step, uint64_t slot,
               MaskWindow w) override {
    run("dropout", elements(n, 2), [&] { in_->dropout(dst, src, n, p, seed, step, slot, w); });
  }
  void to_bf16(uint16_t* dst, const float* src, int64_t n) override {
    run("to_bf16", elements(n, 1.5), [&] { in_->to_bf16(dst, src, n); });
  }
  void from_bf16(float* dst, const uint16_t* src, int64_t n) override {
    run("from_bf16", elements(n, 1.5), [&] { in_->from_bf16(dst, src, n); });
  }
  void to_f16(uint16_t* dst, const float* src, int64_t n) override {
    run("to_f16", elements(n, 1.5), [&] { in_->to_f16(dst, src, n); });
  }

  void attention(const AttentionShape& s, const float* q, const KvRows& kv, float* out, int64_t T,
                 const int32_t* pos, const int32_t* seq_start) override {
    double ctx = 0;
    for (int64_t t = 0; t < T; ++t) ctx += pos[t] + 1 - (seq_start ? seq_start[t] : 0);
    run("attention", attention_info(s, T, ctx, 4), [&] { in_->attention(s, q, kv, out, T, pos, seq_start); });
  }
  void paged_attention(const AttentionShape& s, const PagedKvView& kv, const float* q, float* out, int64_t T,
                       const int32_t* pos, const int32_t* const* tables) override {
    double ctx = 0;
    for (int64_t t = 0; t < T; ++t) ctx += pos[t] + 1;
    run("attention", attention_info(s, T, ctx, 4), [&] { in_->paged_attention(s, kv, q, out, T, pos, tables); });
  }
  void paged_store(const AttentionShape& s, void* k_store, void* v_store, DType dtype, int64_t block_size,
                   const float* k, const float* v, const int64_t* slots, int64_t T) override {
    run("kv_store", rows(T, 0), [&] { in_->paged_store(s, k_store, v_store, dtype, block_size, k, v, slots, T); });
  }
  void attention_train(Workspace& ws, const AttentionShape& s, float* out, float* lse, const float* q,
                       const float* k, const float* v, int64_t T, const int32_t* seq_start) override {
    run("attention", attention_info(s, T, packed_context(T, seq_start), 4),
        [&] { in_->attention_train(ws, s, out, lse, q, k, v, T, seq_start); });
  }
  // QK^T recomputed from the saved lse, then dV, dP, dQ, dK: five products.
  void attention_backward(Workspace& ws, const AttentionShape& s, float* dq, float* dk, float* dv, const float* dout,
                          const float* q, const float* k, const float* v, const float* out, const float* lse,
                          int64_t T, const int32_t* seq_start) override {
    run("attention_backward", attention_info(s, T, packed_context(T, seq_start), 10),
        [&] { in_->attention_backward(ws, s, dq, dk, dv, dout, q, k, v, out, lse, T, seq_start); });
  }

  // The output projection's product over the rows with a label (the fused
  // loss skips the others), again for dh and again for dW when asked.
  LossResult cross_entropy(Workspace& ws, const LossOp& op) override {
    int64_t labelled = op.T;
    if (op.labels) labelled = std::count_if(op.labels, op.labels + op.T, [](int32_t l) { return l != -100; });
    OpInfo o = product(labelled, op.W->rows(), op.W->cols(), op.W->dtype, op.W->nbytes());
    o.flops *= 1.0 + (op.dh ? 1.0 : 0.0) + (op.dW ? 1.0 : 0.0);
    return run("loss", o, [&] { return in_->cross_entropy(ws, op); });
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                        int64_t T, int64_t n) override {
    run("rmsnorm_backward", rows(T, 4.0 * static_cast<double>(T * n)),
        [&] { in_->rmsnorm_backward(dx, dw, dout, x, w, rstd, T, n); });
  }
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                       int64_t n) override {
    run("swiglu_backward", elements(n, 5), [&] { in_->swiglu_backward(dgate, dup, dout, gate, up, n); });
  }
  void linear_backward_input(Workspace& ws, const Tensor& W, const DeviceWeight* Wt, BackwardPrecision p,
                             const float* dy, float* dx, int64_t T, bool accumulate) override {
    const OpInfo o = Wt ? product(T, W.cols(), W.rows(), Wt->dtype(), Wt->nbytes())
                        : product(T, W.cols(), W.rows(), W.dtype, W.nbytes());
    run("linear_backward_input", o, [&] { in_->linear_backward_input(ws, W, Wt, p, dy, dx, T, accumulate); });
  }
  // dW [N, K] += dy^T x: read dy and x, read and write dW.
  void linear_backward_weight(Workspace& ws, const float* dy, const float* x, float* dW, int64_t T, int64_t N,
                              int64_t K) override {
    OpInfo o = product(T, N, K, DType::f32, 2 * sizeof(float) * static_cast<size_t>(N * K));
    run("linear_backward_weight", o, [&] { in_->linear_backward_weight(ws, dy, x, dW, T, N, K); });
  }
  void linear_backward_bias(const float* dy, float* db, int64_t T, int64_t N) override {
    run("linear_backward_bias", rows(T, static_cast<double>(T * N)), [&] { in_->linear_backward_bias(dy, db, T, N); });
  }
  void embedding_backward(float* dW, const float* dout, const int32_t* tokens, int64_t T, int64_t vocab,
                          int64_t H) override {
    run("embedding_backward", rows(T, 2.0 * static_cast<double>(T * H)),
        [&] { in_->embedding_backward(dW, dout, tokens, T, vocab, H); });
  }

  // p, g, m, v read; p, m, v written.
  void adamw_update(const AdamWUpdate& u, float* p, const float* g, float* m, float* v, size_t n) override {
    run("adamw", elements(static_cast<int64_t>(n), 7), [&] { in_->adamw_update(u, p, g, m, v, n); });
  }
  // p, g, m, v, gap read; p, m, v, gap written.
  void adamw_lazy_update(const AdamWLazyUpdate& u, float* p, const float* g, float* m, float* v, float* gap,
                         size_t n) override {
    run("adamw_lazy", elements(static_cast<int64_t>(n), 9), [&] { in_->adamw_lazy_update(u, p, g, m, v, gap, n); });
  }
  void quantize_blockwise(const Blockwise8Map& map, const float* x, size_t n, uint8_t* codes, float* absmax) override {
    run("quantize_blockwise", elements(static_cast<int64_t>(n), 1.25),
        [&] { in_->quantize_blockwise(map, x, n, codes, absmax); });
  }
  void dequantize_blockwise(const Blockwise8Map& map, const uint8_t* codes, const float* absmax, size_t n,
                            float* out) override {
    run("dequantize_blockwise", elements(static_cast<int64_t>(n), 1.25),
        [&] { in_->dequantize_blockwise(map, codes, absmax, n, out); });
  }
  // p, g read, p written (4 bytes each), the two 8-bit moments read and written.
  void adamw8bit_update(const Adam8bitUpdate& u, float* p, const float* g, const Adam8bitState& s,
                        size_t n) override {
    run("adamw8bit", elements(static_cast<int64_t>(n), 4), [&] { in_->adamw8bit_update(u, p, g, s, n); });
  }
  double sum_squares(const float* x, size_t n) override {
    return run("sum_squares", elements(static_cast<int64_t>(n), 1), [&] { return in_->sum_squares(x, n); });
  }

 private:
  static OpInfo rows(int64_t T, double flops) {
    OpInfo o;
    o.T = T;
    o.flops = flops;
    return o;
  }
  // An elementwise op over n floats moving `floats_per_element` floats each.
  static OpInfo elements(int64_t n, double floats_per_element) {
    OpInfo o;
    o.bytes = f32_bytes(static_cast<double>(n) * floats_per_element);
    return o;
  }
  // Causal pairs of packed rows: row t sees t - seq_start[t] + 1 keys.
  static double packed_context(int64_t T, const int32_t* seq_start) {
    double ctx = 0;
    for (int64_t t = 0; t < T; ++t) ctx += static_cast<double>(t - (seq_start ? seq_start[t] : 0) + 1);
    return ctx;
  }

  // Runs f; while recording, as a span with the pool's busy time over it.
  template <class F>
  std::invoke_result_t<F&> run(const char* name, const OpInfo& info, F&& f) {
    if (!t_.recording()) {
      if (pool_.accounting()) pool_.set_accounting(false);
      return f();
    }
    if (!pool_.accounting()) pool_.set_accounting(true);
    const ThreadPool::WorkTime w0 = pool_.work_time();
    const int64_t start = t_.now_ns();
    struct Record {  // after f, also when it returns a value
      ProfilingBackend& b;
      const char* name;
      const OpInfo& info;
      ThreadPool::WorkTime w0;
      int64_t start;
      ~Record() { b.record(name, info, w0, start); }
    } record{*this, name, info, w0, start};
    return f();
  }

  void record(const char* name, const OpInfo& info, ThreadPool::WorkTime w0, int64_t start) {
    const int64_t end = t_.now_ns();
    const ThreadPool::WorkTime w1 = pool_.work_time();
    TraceEvent e;
    e.name = name;
    e.cat = "op";
    e.ts_ns = start;
    e.dur_ns = end - start;
    e.phase = t_.phase();
    e.layer = t_.layer();
    e.T = info.T, e.N = info.N, e.K = info.K;
    e.dtype = info.dtype;
    e.flops = info.flops;
    e.bytes = info.bytes;
    e.threads = pool_.size();
    // The caller's time outside run() was serial work; inside it, the indices' time.
    const int64_t serial = e.dur_ns - (w1.in_run_ns - w0.in_run_ns);
    e.busy_ns = std::max<int64_t>(0, (w1.busy_ns - w0.busy_ns) + serial);
    t_.add(e);
  }

  std::unique_ptr<Backend> in_;
  Tracer& t_;
  ThreadPool& pool_;
};

}  // namespace

std::unique_ptr<Backend> make_profiling_backend(std::unique_ptr<Backend> inner, Tracer& tracer, ThreadPool& pool) {
  return std::make_unique<ProfilingBackend>(std::move(inner), tracer, pool);
}

}  // namespace loom
