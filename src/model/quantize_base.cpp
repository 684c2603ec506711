#include "model/quantize_base.h"

#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include "core/error.h"
#include "kernels/cpu/dequant.h"
#include "kernels/ref/dequant_ref.h"
#include "kernels/ref/nf4_ref.h"

namespace loom {
namespace {

bool float_source(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// Drops the whole pages inside [p, p + n) of a read-only file mapping; the
// kernel refaults them from the file if they are read again.
void release_pages(const void* p, size_t n) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace

bool quantize_base_supported(DType t) { return t == DType::q8_0 || t == DType::q4_0 || t == DType::nf4; }

void quantize_matrix(const Tensor& src, DType target, uint8_t* dst) {
  LOOM_ASSERT(quantize_base_supported(target) && float_source(src.dtype));
  const int64_t rows = src.rows(), cols = src.cols();
  LOOM_ASSERT(cols % dtype_block_size(target) == 0);
  std::vector<float> row(static_cast<size_t>(cols));
  auto expand = [&](int64_t r) {
    dequantize_row(src.dtype, src.row_ptr(r), row.data(), cols);
    return row.data();
  };
  if (target == DType::nf4) {
    quantize_tensor_nf4(rows, cols, expand, reinterpret_cast<BlockNF4*>(dst));
    return;
  }
  const size_t out_row = dtype_row_bytes(target, cols);
  for (int64_t r = 0; r < rows; ++r) quantize_row_ref(target, expand(r), dst + r * out_row, cols);
}

void quantize_base_weights(ModelWeights& w, DType target, const std::string& source, bool release_source) {
  if (!quantize_base_supported(target))
    fail(ErrorKind::invalid_input, "quantize_base: {} is not one of nf4, q4_0, q8_0", dtype_name(target));
  static const char* const kNames[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  const int64_t bs = dtype_block_size(target);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    LayerWeights& L = w.layers[l];
    if (!L.held()) continue;  // another pipeline stage's layer: no copy here
    Tensor* mats[] = {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down};
    for (int i = 0; i < 7; ++i) {
      Tensor& t = *mats[i];
      if (!float_source(t.dtype))
        fail(ErrorKind::invalid_input,
             "{}: quantize_base {} needs f32, f16 or bf16 weights, but layer {} {} is {} (use the model's "
             "f16/bf16 form, or quantize_base: none)",
             source, dtype_name(target), l, kNames[i], dtype_name(t.dtype));
      if (t.cols() % bs != 0)
        fail(ErrorKind::invalid_input, "{}: quantize_base {}: layer {} {} has {} columns, not a multiple of {}",
             source, dtype_name(target), l, kNames[i], t.cols(), bs);
      auto& buf = w.owned_bytes.emplace_back(static_cast<size_t>(t.rows()) * dtype_row_bytes(target, t.cols()));
      quantize_matrix(t, target, buf.data());
      if (release_source) release_pages(t.data, t.nbytes());
      t.data = buf.data();
      t.dtype = target;
    }
  }
}

}  // namespace loom
