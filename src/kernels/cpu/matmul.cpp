// matmul driver: checks arguments, quantizes activations once per call, splits
// panels (or tokens) over the pool and picks the AVX2 or AVX-512 kernels.
#include "kernels/matmul.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/cpu/panel.h"

namespace loom {
namespace {

using cpu::kPanelRows;

constexpr int64_t kFlyGroup = 4;  // panels packed at a time by matmul(Tensor)
constexpr int64_t kAmxMinT = 8;   // AMX tiles pay off from about this many tokens

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Panel stride: a multiple of 64 bytes keeps every panel cache-line aligned.
size_t panel_stride(DType type, int64_t K) { return round_up(cpu::panel_bytes(type, K), 64); }

void check_weight(const Tensor& W, const char* name) {
  if (!matmul_supports(W.dtype))
    fail(ErrorKind::unsupported, "matmul: weight '{}' has type {}, which has no matmul kernel", name,
         dtype_name(W.dtype));
  if (W.ndim < 1 || W.data == nullptr)
    fail(ErrorKind::invalid_input, "matmul: weight '{}' is empty (shape {})", name, W.shape_string());
  const int64_t bs = dtype_block_size(W.dtype);
  if (W.cols() <= 0 || W.cols() % bs != 0)
    fail(ErrorKind::invalid_input, "matmul: weight '{}' of type {} has {} columns, not a positive multiple of {}",
         name, dtype_name(W.dtype), W.cols(), bs);
}

// What matmul needs to know about W, packed or not.
struct Source {
  DType type;
  int64_t N, K;
  const uint8_t* packed;  // null: pack on the fly from raw
  size_t pstride;
  const uint8_t* raw;
  size_t row_bytes;
};

void run_matmul(cpu::Isa isa, ThreadPool& pool, const Source& s, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t T,
                MatmulScratch& scratch) {
  if (T < 0) fail(ErrorKind::invalid_input, "matmul: negative token count {}", T);
  if (ldx < s.K || ldy < s.N)
    fail(ErrorKind::invalid_input, "matmul: strides ldx={} ldy={} smaller than K={} N={}", ldx, ldy, s.K, s.N);
  if (T == 0 || s.N == 0) return;

  const int nt = pool.size();
  const int64_t np = (s.N + kPanelRows - 1) / kPanelRows;
  // Split panels when there are enough of them; otherwise split tokens.
  const bool split_tokens = T > 1 && np < 2 * nt;
  const bool fly = s.packed == nullptr;
  const bool raw_type = cpu::panel_is_raw(s.type);
  const cpu::ActKind kind = cpu::act_kind(s.type);
  const size_t arb = cpu::act_row_bytes(s.type, s.K);
  // AMX only with a panel split: its tiles read act rows in groups of 16 tokens.
  const bool use_amx = isa == cpu::Isa::amx && !split_tokens && T >= kAmxMinT && cpu::amx_supports(s.type) &&
                       cpu::amx_available();
  const int64_t t_alloc = use_amx ? (T + 15) / 16 * 16 : T;

  // Per-worker scratch (grown here, on the calling thread, before any worker runs).
  const size_t fly_bytes = fly ? static_cast<size_t>(kFlyGroup) * s.pstride : 0;
  size_t tmp_bytes = raw_type ? static_cast<size_t>(s.K) * kPanelRows * sizeof(float) : 0;
  if (use_amx) tmp_bytes = static_cast<size_t>(s.K) * kPanelRows;  // unpacked 8-bit panel
  if (fly_bytes + tmp_bytes > 0)
    for (int i = 0; i < nt; ++i) scratch.get(1 + static_cast<size_t>(i), fly_bytes + tmp_bytes);

  const uint8_t* act = reinterpret_cast<const uint8_t*>(x);
  size_t astride = static_cast<size_t>(ldx) * sizeof(float);
  uint8_t* qbuf = nullptr;
  if (kind != cpu::ActKind::f32) {
    qbuf = scratch.get(0, arb * static_cast<size_t>(t_alloc));
    if (t_alloc > T) std::memset(qbuf + arb * static_cast<size_t>(T), 0, arb * static_cast<size_t>(t_alloc - T));
    act = qbuf;
    astride = arb;
    // Token-split workers quantize their own rows; otherwise quantize up front.
    if (!split_tokens) {
      auto quant = [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) cpu::quantize_act_row(s.type, x + t * ldx, s.K, qbuf + t * arb);
      };
      if (T >= 4 && nt > 1)
        pool.parallel_for(T, quant);
      else
        quant(0, T);
    }
  }

  const cpu::PanelKernel kernel = use_amx                   ? cpu::panel_kernel_amx
                                  : isa == cpu::Isa::avx2 ? cpu::panel_kernel_avx2
                                                          : cpu::panel_kernel_avx512;

  auto work = [&](int ti, int tn) {
    int64_t p0 = 0, p1 = np, t0 = 0, t1 = T;
    if (split_tokens) {
      t0 = T * ti / tn;
      t1 = T * (ti + 1) / tn;
      if (qbuf != nullptr)
        for (int64_t t = t0; t < t1; ++t) cpu::quantize_act_row(s.type, x + t * ldx, s.K, qbuf + t * arb);
    } else {
      p0 = np * ti / tn;
      p1 = np * (ti + 1) / tn;
    }
    if (p0 >= p1 || t0 >= t1) return;
    uint8_t* wb = fly_bytes + tmp_bytes > 0 ? scratch.ptr(1 + static_cast<size_t>(ti)) : nullptr;
    cpu::KernelArgs a;
    a.K = s.K;
    a.act = act + static_cast<size_t>(t0) * astride;
    a.act_stride = astride;
    a.T = t1 - t0;
    a.ldy = ldy;
    a.tmp = tmp_bytes > 0 ? reinterpret_cast<float*>(wb + fly_bytes) : nullptr;
    const int64_t group = fly ? kFlyGroup : p1 - p0;
    for (int64_t p = p0; p < p1; p += group) {
      const int64_t pn = p + group < p1 ? group : p1 - p;
      if (fly) {
        for (int64_t i = 0; i < pn; ++i) {
          const int64_t r0 = (p + i) * kPanelRows;
          const int rows = static_cast<int>(s.N - r0 < kPanelRows ? s.N - r0 : kPanelRows);
          const uint8_t* rp[kPanelRows];
          for (int r = 0; r < rows; ++r) rp[r] = s.raw + static_cast<size_t>(r0 + r) * s.row_bytes;
          cpu::pack_panel(s.type, rp, rows, s.K, wb + static_cast<size_t>(i) * s.pstride);
        }
        a.panels = wb;
      } else {
        a.panels = s.packed + static_cast<size_t>(p) * s.pstride;
      }
      a.panel_stride = s.pstride;
      a.n_panels = pn;
      a.y = y + t0 * ldy + p * kPanelRows;
      a.n_valid = s.N - p * kPanelRows;
      kernel(s.type, a);
    }
  };
  if (nt == 1)
    work(0, 1);
  else
    pool.run(work);
}

}  // namespace

void AlignedFree::operator()(uint8_t* p) const { std::free(p); }

AlignedBytes alloc_aligned(size_t bytes) {
  void* p = std::aligned_alloc(64, round_up(bytes > 0 ? bytes : 1, 64));
  if (p == nullptr) fail(ErrorKind::internal, "out of memory allocating {} bytes", bytes);
  return AlignedBytes(static_cast<uint8_t*>(p));
}

uint8_t* MatmulScratch::get(size_t slot, size_t bytes) {
  if (bufs_.size() <= slot) bufs_.resize(slot + 1);
  Buf& b = bufs_[slot];
  if (b.size < bytes) {
    b.ptr = alloc_aligned(bytes + bytes / 4);  // headroom against regrowing
    b.size = bytes + bytes / 4;
  }
  return b.ptr.get();
}

bool matmul_supports(DType type) {
  switch (type) {
    case DType::f32: case DType::f16: case DType::bf16:
    case DType::q4_0: case DType::q4_1: case DType::q5_0: case DType::q5_1: case DType::q8_0:
    case DType::q2_k: case DType::q3_k: case DType::q4_k: case DType::q5_k: case DType::q6_k:
      return true;
    default:
      return false;
  }
}

PackedWeight PackedWeight::pack(const Tensor& W, ThreadPool* pool, const char* name) {
  return pack_concat(std::span<const Tensor>(&W, 1), pool, name);
}

PackedWeight PackedWeight::pack_concat(std::span<const Tensor> parts, ThreadPool* pool, const char* name) {
  if (parts.empty()) fail(ErrorKind::invalid_input, "matmul: no tensors to pack for '{}'", name);
  int64_t N = 0;
  for (const Tensor& W : parts) {
    check_weight(W, name);
    if (W.dtype != parts[0].dtype || W.cols() != parts[0].cols())
      fail(ErrorKind::invalid_input, "matmul: '{}' stacks tensors of different type or width ({} {} vs {} {})", name,
           dtype_name(W.dtype), W.shape_string(), dtype_name(parts[0].dtype), parts[0].shape_string());
    N += W.rows();
  }
  PackedWeight pw;
  pw.dtype_ = parts[0].dtype;
  pw.n_ = N;
  pw.k_ = parts[0].cols();
  pw.panel_bytes_ = panel_stride(pw.dtype_, pw.k_);
  pw.n_panels_ = static_cast<size_t>((N + kPanelRows - 1) / kPanelRows);
  pw.data_ = alloc_aligned(pw.n_panels_ * pw.panel_bytes_);
  const size_t used = cpu::panel_bytes(pw.dtype_, pw.k_);
  auto row_ptr = [&](int64_t n) {
    for (const Tensor& W : parts) {
      if (n < W.rows()) return W.row_ptr(n);
      n -= W.rows();
    }
    return static_cast<const uint8_t*>(nullptr);
  };
  auto pack_range = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = p * kPanelRows;
      const int rows = static_cast<int>(N - r0 < kPanelRows ? N - r0 : kPanelRows);
      const uint8_t* rp[kPanelRows];
      for (int r = 0; r < rows; ++r) rp[r] = row_ptr(r0 + r);
      uint8_t* dst = pw.data_.get() + static_cast<size_t>(p) * pw.panel_bytes_;
      cpu::pack_panel(pw.dtype_, rp, rows, pw.k_, dst);
      std::memset(dst + used, 0, pw.panel_bytes_ - used);
    }
  };
  const auto np = static_cast<int64_t>(pw.n_panels_);
  if (pool != nullptr)
    pool->parallel_for(np, pack_range);
  else
    pack_range(0, np);
  return pw;
}

namespace cpu {

bool amx_available() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    // Linux hands out the (8 KB) tile state only on request, once per process.
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void matmul_isa(Isa isa, ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
                int64_t T, MatmulScratch& scratch) {
  if (W.empty()) fail(ErrorKind::invalid_input, "matmul: empty PackedWeight");
  const Source s{W.dtype(), W.rows(), W.cols(), W.panel(0), W.panel_bytes(), nullptr, 0};
  run_matmul(isa, pool, s, x, ldx, y, ldy, T, scratch);
}

void matmul_isa(Isa isa, ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y, int64_t ldy,
                int64_t T, MatmulScratch& scratch) {
  check_weight(W, "W");
  const Source s{W.dtype, W.rows(), W.cols(), nullptr, panel_stride(W.dtype, W.cols()),
                 static_cast<const uint8_t*>(W.data), W.row_bytes()};
  run_matmul(isa, pool, s, x, ldx, y, ldy, T, scratch);
}

}  // namespace cpu

namespace {
// LOOM_CPU=avx2 (checked by use_avx512_kernels) forces AVX2; LOOM_CPU=avx512
// keeps AVX-512 but leaves AMX unused.
cpu::Isa default_isa() {
  static const cpu::Isa isa = [] {
    if (!use_avx512_kernels()) return cpu::Isa::avx2;
    const char* force = std::getenv("LOOM_CPU");
    if (force != nullptr && std::strcmp(force, "avx512") == 0) return cpu::Isa::avx512;
    return cpu::amx_available() ? cpu::Isa::amx : cpu::Isa::avx512;
  }();
  return isa;
}
}  // namespace

void matmul(ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t T,
            MatmulScratch& scratch) {
  cpu::matmul_isa(default_isa(), pool, W, x, ldx, y, ldy, T, scratch);
}

void matmul(ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t T,
            MatmulScratch& scratch) {
  cpu::matmul_isa(default_isa(), pool, W, x, ldx, y, ldy, T, scratch);
}

}  // namespace loom
