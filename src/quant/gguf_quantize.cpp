#include "quant/gguf_quantize.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "io/gguf.h"
#include "io/gguf_writer.h"
#include "kernels/cpu/dequant.h"
#include "kernels/quantize.h"

namespace loom {
namespace {

constexpr uint32_t kQuantizationVersion = 2;  // ggml's GGML_QNT_VERSION
// Rows expanded to f32 at a time: bounds the scratch (~64 MiB of f32).
constexpr int64_t kScratchElements = int64_t{16} << 20;

int64_t rows_of(const std::vector<int64_t>& shape) {
  int64_t r = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return r;
}

std::vector<int64_t> shape_of(const gguf::TensorInfo& t) {
  return {t.shape.begin(), t.shape.begin() + t.ndim};
}

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

// Expands `rows` rows of `t` (any type) to f32 and quantizes them to `to`.
void convert_rows(ThreadPool& pool, const gguf::TensorInfo& t, DType to, const float* importance, int64_t row0,
                  int64_t rows, int64_t cols, std::vector<float>& f32, uint8_t* dst) {
  const size_t in_row = dtype_row_bytes(t.dtype, cols);
  const float* src = nullptr;
  if (t.dtype == DType::f32) {
    src = reinterpret_cast<const float*>(t.data + static_cast<size_t>(row0) * in_row);
  } else {
    f32.resize(static_cast<size_t>(rows * cols));
    pool.parallel_for(rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        dequantize_row(t.dtype, t.data + static_cast<size_t>(row0 + r) * in_row, f32.data() + r * cols, cols);
    });
    src = f32.data();
  }
  quantize_rows(pool, to, src, dst, rows, cols, importance);
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

ModelShapeInfo model_shape_of(const gguf::File& f) {
  const std::string arch = f.get_string("general.architecture");
  ModelShapeInfo m;
  m.n_layers = static_cast<int64_t>(f.get_uint(arch + ".block_count"));
  m.n_heads = static_cast<int64_t>(f.get_uint(arch + ".attention.head_count"));
  m.n_kv_heads = static_cast<int64_t>(f.opt_uint(arch + ".attention.head_count_kv").value_or(m.n_heads));
  m.is_70b = m.n_layers == 80 && (arch == "llama" || arch == "qwen2");
  return m;
}

QuantizeSummary quantize_gguf(ThreadPool& pool, const gguf::File& src, const std::string& out,
                              const GgufQuantizeOptions& opt,
                              const std::function<void(const TensorPlan&, size_t, size_t)>& on_tensor) {
  std::vector<TensorInput> inputs;
  for (const auto& t : src.tensors()) inputs.push_back({t.name, t.dtype, shape_of(t)});
  QuantizeSummary summary;
  summary.plan = plan_quantization(std::move(inputs), model_shape_of(src), opt.plan);
  for (const TensorPlan& p : summary.plan) {
    if (p.to == p.from) continue;
    if (!quantize_supported(p.to))
      fail(ErrorKind::unsupported, "{}: tensor '{}' would become {}, which loom cannot write", src.path(), p.name,
           dtype_name(p.to));
    if (dtype_is_quantized(p.from) && !opt.allow_requantize)
      fail(ErrorKind::invalid_input,
           "{}: tensor '{}' is already {}; quantizing it again to {} adds a second rounding error. Start from an "
           "f32/f16/bf16 model, or pass --allow-requantize",
           src.path(), p.name, dtype_name(p.from), dtype_name(p.to));
  }

  gguf::Writer w;
  gguf::copy_metadata(src, w);
  set_quantize_metadata(w, opt);
  std::vector<float> f32;
  for (size_t i = 0; i < summary.plan.size(); ++i) {
    const TensorPlan& p = summary.plan[i];
    const gguf::TensorInfo& t = *src.find_tensor(p.name);
    const std::vector<int64_t> shape = shape_of(t);
    const int64_t rows = rows_of(shape), cols = shape.back();
    summary.bytes_in += t.nbytes;
    summary.bytes_out += static_cast<uint64_t>(rows) * dtype_row_bytes(p.to, cols);
    summary.elements += rows * cols;
    summary.fallbacks += p.fallback ? 1 : 0;
    const float* importance = p.to != p.from ? importance_for(opt, src.path(), p, cols, summary) : nullptr;
    w.add_tensor(p.name, p.to, shape, [&, i, importance, rows, cols](uint8_t* dst) {
      if (on_tensor) on_tensor(p, i, summary.plan.size());
      if (p.to == p.from) {
        std::memcpy(dst, t.data, t.nbytes);
        return;
      }
      const int64_t step = std::max<int64_t>(1, kScratchElements / cols);
      const size_t out_row = dtype_row_bytes(p.to, cols);
      for (int64_t r = 0; r < rows; r += step) {
        const int64_t n = std::min(step, rows - r);
        convert_rows(pool, t, p.to, importance, r, n, cols, f32, dst + static_cast<size_t>(r) * out_row);
      }
    });
  }
  w.write(out);
  return summary;
}

}  // namespace loom
