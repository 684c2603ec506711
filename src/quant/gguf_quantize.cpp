#include "quant/gguf_quantize.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "core/error.h"
#include "io/gguf_writer.h"
#include "kernels/quantize.h"
#include "model/gguf_export.h"

namespace loom {
namespace {

constexpr uint32_t kQuantizationVersion = 2;  // ggml's GGML_QNT_VERSION
// Rows expanded to f32 at a time: bounds the scratch (~64 MiB of f32).
constexpr int64_t kScratchElements = int64_t{16} << 20;

// The importance row for a tensor, or null; throws for a width mismatch
// (llama-quantize refuses it too, except for the token embedding).
const float* importance_for(const GgufQuantizeOptions& opt, const std::string& file, const TensorPlan& p,
                            int64_t cols, QuantizeSummary& summary) {
  if (opt.importance == nullptr) return nullptr;
  const auto it = opt.importance->find(p.name);
  if (it == opt.importance->end()) {
    summary.without_importance.push_back(p.name);
    return nullptr;
  }
  if (static_cast<int64_t>(it->second.size()) == cols) return it->second.data();
  if (p.name == "token_embd.weight") return nullptr;
  fail(ErrorKind::invalid_input, "{}: the imatrix entry for '{}' has {} columns, the tensor has {}", file, p.name,
       it->second.size(), cols);
}

// Expands `rows` rows of `t` (any type, rows in output order) to f32 and quantizes them to `to`.
void convert_rows(ThreadPool& pool, const GgufTensorSource& t, DType to, const float* importance, int64_t row0,
                  int64_t rows, std::vector<float>& f32, uint8_t* dst) {
  const int64_t cols = t.cols();
  const float* src = nullptr;
  if (t.view.dtype == DType::f32 && t.qk_heads == 0) {
    src = reinterpret_cast<const float*>(t.source_row(row0));
  } else {
    f32.resize(static_cast<size_t>(rows * cols));
    pool.parallel_for(rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) t.row_f32(row0 + r, f32.data() + r * cols);
    });
    src = f32.data();
  }
  quantize_rows(pool, to, src, dst, rows, cols, importance);
}

// The stored bytes, rows in output order.
void copy_rows(const GgufTensorSource& t, uint8_t* dst) {
  const size_t row = dtype_row_bytes(t.view.dtype, t.cols());
  if (t.qk_heads == 0) {
    std::memcpy(dst, t.source_row(0), row * static_cast<size_t>(t.rows()));
    return;
  }
  for (int64_t r = 0; r < t.rows(); ++r) std::memcpy(dst + static_cast<size_t>(r) * row, t.source_row(r), row);
}

void set_quantize_metadata(gguf::Writer& w, const GgufQuantizeOptions& opt) {
  w.set_u32("general.quantization_version", kQuantizationVersion);
  w.set_u32("general.file_type", static_cast<uint32_t>(opt.plan.file_type));
  for (const char* k : {"split.no", "split.count", "split.tensors.count"}) w.erase(k);
  if (opt.importance == nullptr) return;
  w.set_string("quantize.imatrix.file", opt.imatrix_file);
  if (!opt.imatrix_datasets.empty()) w.set_string("quantize.imatrix.dataset", opt.imatrix_datasets.front());
  w.set_u32("quantize.imatrix.entries_count", static_cast<uint32_t>(opt.importance->size()));
  if (opt.imatrix_chunks > 0) w.set_u32("quantize.imatrix.chunks_count", static_cast<uint32_t>(opt.imatrix_chunks));
}

}  // namespace

ModelShapeInfo model_shape_of(const GgufModelSource& src) {
  ModelShapeInfo m;
  m.n_layers = src.n_layers;
  m.n_heads = src.n_heads;
  m.n_kv_heads = src.n_kv_heads;
  m.is_70b = m.n_layers == 80 && (src.arch == "llama" || src.arch == "qwen2");
  return m;
}

QuantizeSummary quantize_gguf(ThreadPool& pool, const GgufModelSource& src, const std::string& out,
                              const GgufQuantizeOptions& opt,
                              const std::function<void(const TensorPlan&, size_t, size_t)>& on_tensor) {
  std::vector<TensorInput> inputs;
  std::map<std::string, const GgufTensorSource*> by_name;
  for (const auto& t : src.tensors) {
    inputs.push_back({t.name, t.view.dtype, t.shape});
    by_name[t.name] = &t;
  }
  QuantizeSummary summary;
  summary.plan = plan_quantization(std::move(inputs), model_shape_of(src), opt.plan);
  for (const TensorPlan& p : summary.plan) {
    if (p.to == p.from) continue;
    if (!quantize_supported(p.to))
      fail(ErrorKind::unsupported, "{}: tensor '{}' would become {}, which loom cannot write", src.path, p.name,
           dtype_name(p.to));
    if (plan_requires_importance(p, opt.plan.file_type) &&
        (opt.importance == nullptr || !opt.importance->contains(p.name)))
      fail(ErrorKind::invalid_input,
           "{}: tensor '{}' would become {}, which needs an importance matrix: without one its rounding error is "
           "too large to be useful (llama-quantize refuses it too). Pass --imatrix with an entry for this tensor "
           "(loom imatrix or llama-imatrix), or choose another type",
           src.path, p.name, dtype_name(p.to));
    if (dtype_is_quantized(p.from) && dtype_is_quantized(p.to) && !opt.allow_requantize)
      fail(ErrorKind::invalid_input,
           "{}: tensor '{}' is already {}; quantizing it again to {} adds a second rounding error. Start from an "
           "f32/f16/bf16 model, or pass --allow-requantize",
           src.path, p.name, dtype_name(p.from), dtype_name(p.to));
  }

  gguf::Writer w;
  src.write_metadata(w);
  set_quantize_metadata(w, opt);
  std::vector<float> f32;
  for (size_t i = 0; i < summary.plan.size(); ++i) {
    const TensorPlan& p = summary.plan[i];
    const GgufTensorSource& t = *by_name.at(p.name);
    const int64_t rows = t.rows(), cols = t.cols();
    summary.bytes_in += static_cast<uint64_t>(rows) * dtype_row_bytes(t.view.dtype, cols);
    summary.bytes_out += static_cast<uint64_t>(rows) * dtype_row_bytes(p.to, cols);
    summary.elements += rows * cols;
    summary.fallbacks += p.fallback ? 1 : 0;
    const float* importance = p.to != p.from ? importance_for(opt, src.path, p, cols, summary) : nullptr;
    w.add_tensor(p.name, p.to, t.shape, [&, i, importance, rows, cols](uint8_t* dst) {
      if (on_tensor) on_tensor(p, i, summary.plan.size());
      if (p.to == p.from) {
        copy_rows(t, dst);
        return;
      }
      const int64_t step = std::max<int64_t>(1, kScratchElements / cols);
      const size_t out_row = dtype_row_bytes(p.to, cols);
      for (int64_t r = 0; r < rows; r += step) {
        const int64_t n = std::min(step, rows - r);
        try {
          convert_rows(pool, t, p.to, importance, r, n, f32, dst + static_cast<size_t>(r) * out_row);
        } catch (const Error& e) {  // (a row the grid searches refuse): name the tensor and where its rows start
          fail(e.kind(), "{}: tensor '{}', rows from {}: {}", src.path, p.name, r, e.what());
        }
      }
    });
  }
  w.write(out);
  return summary;
}

}  // namespace loom
