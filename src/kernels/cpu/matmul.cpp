// matmul driver: checks arguments, quantizes activations once per call, splits
// panels (or tokens) over the pool and picks the AVX2 or AVX-512 kernels.
#include "kernels/cpu/matmul.h"

#include <cstdlib>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/panel.h"
#include "kernels/ref/i8ch_ref.h"

namespace loom {
namespace {

using cpu::kPanelRows;

constexpr int64_t kFlyGroup = 4;  // panels packed at a time by matmul(Tensor)
constexpr int64_t kAmxMinT = 8;   // AMX tiles pay off from about this many tokens
// Unpacking a batch's panels once per call (the types with an unpacked kernel,
// panel.h) pays off from about two token tiles per worker; below that the tiles
// unpack each panel about once anyway.
constexpr int64_t kUnpackMinT = 16;

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
    fail(ErrorKind::invalid_input,
         "matmul: weight '{}' of type {} has {} columns, not a positive multiple of {}", name,
         dtype_name(W.dtype), W.cols(), bs);
  if (W.dtype == DType::i8_ch) {
    // Exact int32 sums need K * 127 * 255 < 2^31 (kernels/ref/i8ch_ref.h).
    if (W.cols() > kI8ChMaxCols)
      fail(ErrorKind::unsupported, "matmul: i8_ch weight '{}' has {} columns; i8_ch products take at most {}", name,
           W.cols(), kI8ChMaxCols);
    for (int64_t r = 0; r < W.rows(); ++r) {
      const I8ChHeader h = i8ch_header(W.row_ptr(r));
      if (!i8ch_header_valid(h))
        fail(ErrorKind::invalid_input,
             "matmul: i8_ch weight '{}' row {} has zero point {}, not an integer in [-128, 127]", name, r, h.zero);
    }
  }
}

// One weight matrix of a matmul call (several share the activations in
// matmul_multi), packed or to be packed on the fly, and where its output goes.
struct Segment {
  int64_t N;
  const uint8_t* packed;  // null: pack on the fly from raw
  size_t pstride;
  const uint8_t* raw;
  size_t row_bytes;
  DType raw_type;  // raw rows' type (the kernel's is matmul_panel_type of it)
  float* y;
  int64_t ldy;
};

// Panels per claim of a panel split (run_matmul): a batch with unpacked panels
// claims one unpack group (unpack_group: what its kernel unpacks at a time,
// about kTileGroupBytes), anything else kClaimPanels (a few panels: whole
// multiples of kFlyGroup, and small enough that a stolen tail evens the threads out).
int64_t panel_chunk(int64_t unpack_group) {
  constexpr int64_t kClaimPanels = 4;
  static_assert(kClaimPanels % kFlyGroup == 0);
  return unpack_group > 0 ? unpack_group : kClaimPanels;
}

void run_matmul(cpu::Isa isa, ThreadPool& pool, DType type, int64_t K, std::span<const Segment> segs,
                const float* x, int64_t ldx, int64_t T, MatmulScratch& scratch) {
  if (T < 0) fail(ErrorKind::invalid_input, "matmul: negative token count {}", T);
  if (ldx < K) fail(ErrorKind::invalid_input, "matmul: input stride ldx={} smaller than K={}", ldx, K);
  int64_t np = 0;  // panels of all segments
  for (const Segment& g : segs) {
    if (g.ldy < g.N)
      fail(ErrorKind::invalid_input, "matmul: output stride ldy={} smaller than N={}", g.ldy, g.N);
    np += (g.N + kPanelRows - 1) / kPanelRows;
  }
  if (T == 0 || np == 0) return;

  const int nt = pool.size();
  // Split panels when there are enough of them; otherwise split tokens.
  const bool split_tokens = T > 1 && np < 2 * nt;
  const bool fly = segs[0].packed == nullptr;
  LOOM_ASSERT(!fly || segs.size() == 1);
  const bool bf16_pairs = cpu::bf16_native(isa);
  const bool vbmi = isa != cpu::Isa::avx2 && usable_cpu_features().avx512vbmi;
  const bool avx_vnni = isa == cpu::Isa::avx2 && usable_cpu_features().avxvnni;  // panel_kernel_avx2_vnni
  const int decode_panels = cpu::decode_panels_quant(usable_cpu_features());
  // AMX only with a panel split: its tiles read act rows in groups of 16 tokens.
  const bool use_amx = isa == cpu::Isa::amx && !split_tokens && T >= kAmxMinT && cpu::amx_supports(type) &&
                       cpu::amx_available();
  const int64_t t_alloc = use_amx ? (T + 15) / 16 * 16 : T;

  // Per-worker scratch (grown here, on the calling thread, before any worker runs).
  const size_t fly_bytes = fly ? static_cast<size_t>(kFlyGroup) * segs[0].pstride : 0;
  const int64_t worker_tokens = split_tokens ? T / nt : T;
  size_t tmp_bytes = 0;
  int64_t unpack_group = 0;  // panels the kernel unpacks at a time (drive_unpacked's group); 0: none
  if (use_amx) {
    tmp_bytes = static_cast<size_t>(K) * kPanelRows;  // AMX: unpacked 8-bit panel
  } else if (worker_tokens >= kUnpackMinT) {
    if (const cpu::UnpackedPanels u = isa != cpu::Isa::avx2 ? cpu::unpacked_panels_avx512(type, K)
                                      : avx_vnni            ? cpu::unpacked_panels_avx2_vnni(type, K)
                                                            : cpu::unpacked_panels_avx2(type, K);
        u.panel_bytes > 0) {
      tmp_bytes = cpu::unpack_scratch_bytes(u);
      unpack_group = static_cast<int64_t>(tmp_bytes / u.panel_bytes) / u.tile_panels * u.tile_panels;
    }
  }
  if (fly_bytes + tmp_bytes > 0)
    for (int i = 0; i < nt; ++i) scratch.get(1 + static_cast<size_t>(i), fly_bytes + tmp_bytes);
  const bool q8k_u8 = isa == cpu::Isa::avx2 && cpu::avx2_u8_acts(type, K, worker_tokens, tmp_bytes);
  const cpu::ActKind kind = q8k_u8 ? cpu::ActKind::q8k_u8 : cpu::act_kind(type, bf16_pairs);
  const size_t arb = cpu::act_row_bytes(kind, K);

  const uint8_t* act = reinterpret_cast<const uint8_t*>(x);
  size_t astride = static_cast<size_t>(ldx) * sizeof(float);
  uint8_t* qbuf = nullptr;
  if (kind != cpu::ActKind::f32) {
    qbuf = scratch.get(0, arb * static_cast<size_t>(t_alloc));
    if (t_alloc > T)
      std::memset(qbuf + arb * static_cast<size_t>(T), 0, arb * static_cast<size_t>(t_alloc - T));
    act = qbuf;
    astride = arb;
    // Token-split workers quantize their own rows; otherwise quantize up front.
    if (!split_tokens) {
      auto quant = [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) cpu::quantize_act_row(kind, type, x + t * ldx, K, qbuf + t * arb);
      };
      if (T >= 4 && nt > 1)
        pool.parallel_for(T, quant);
      else
        quant(0, T);
    }
  }

  const cpu::PanelKernel avx2_kernel = avx_vnni ? cpu::panel_kernel_avx2_vnni : cpu::panel_kernel_avx2;
  const cpu::PanelKernel kernel = use_amx                 ? cpu::panel_kernel_amx
                                  : isa == cpu::Isa::avx2 ? avx2_kernel
                                                          : cpu::panel_kernel_avx512;

  // One range of global panels [g0, g1) for tokens [t0, t1), on worker slot ti.
  auto run_range = [&](int ti, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
    uint8_t* wb = fly_bytes + tmp_bytes > 0 ? scratch.ptr(1 + static_cast<size_t>(ti)) : nullptr;
    cpu::KernelArgs a;
    a.K = K;
    a.act = act + static_cast<size_t>(t0) * astride;
    a.act_stride = astride;
    a.T = t1 - t0;
    a.tmp = tmp_bytes > 0 ? wb + fly_bytes : nullptr;
    a.tmp_bytes = tmp_bytes;
    a.bf16_pairs = bf16_pairs;
    a.q8k_u8 = q8k_u8;
    a.vbmi = vbmi;
    a.decode_panels = decode_panels;
    int64_t base = 0;  // global index of the segment's first panel
    for (const Segment& g : segs) {
      const int64_t gnp = (g.N + kPanelRows - 1) / kPanelRows;
      const int64_t p0 = g0 > base ? g0 - base : 0, p1 = g1 - base < gnp ? g1 - base : gnp;
      base += gnp;
      if (p0 >= p1) continue;
      a.ldy = g.ldy;
      a.panel_stride = g.pstride;
      const int64_t group = fly ? kFlyGroup : p1 - p0;
      for (int64_t p = p0; p < p1; p += group) {
        const int64_t pn = p + group < p1 ? group : p1 - p;
        if (fly) {
          for (int64_t i = 0; i < pn; ++i) {
            const int64_t r0 = (p + i) * kPanelRows;
            const int rows = static_cast<int>(g.N - r0 < kPanelRows ? g.N - r0 : kPanelRows);
            const uint8_t* rp[kPanelRows];
            for (int r = 0; r < rows; ++r) rp[r] = g.raw + static_cast<size_t>(r0 + r) * g.row_bytes;
            cpu::pack_panel(g.raw_type, rp, rows, K, wb + static_cast<size_t>(i) * g.pstride);
          }
          a.panels = wb;
        } else {
          a.panels = g.packed + static_cast<size_t>(p) * g.pstride;
        }
        a.n_panels = pn;
        a.y = g.y + t0 * g.ldy + p * kPanelRows;
        a.n_valid = g.N - p * kPanelRows;
        kernel(type, a);
      }
    }
  };
  // A panel split lets a thread that finishes its share early take chunks from
  // the end of another's (core/range_claims.h): a thread slowed by a busy
  // sibling vCPU, or an efficiency core, then holds the op up less. Which thread
  // runs a panel changes no result (each panel's outputs are its own).
  RangeClaims& claims = scratch.claims();
  if (!split_tokens) claims.reset(np, nt, panel_chunk(unpack_group));
  auto work = [&](int ti, int tn) {
    if (split_tokens) {
      const int64_t t0 = T * ti / tn, t1 = T * (ti + 1) / tn;
      if (t0 >= t1) return;
      if (qbuf != nullptr)
        for (int64_t t = t0; t < t1; ++t) cpu::quantize_act_row(kind, type, x + t * ldx, K, qbuf + t * arb);
      run_range(ti, 0, np, t0, t1);
      return;
    }
    for (int64_t g0, g1; claims.next(ti, &g0, &g1);) run_range(ti, g0, g1, 0, T);
  };
  if (nt == 1)
    work(0, 1);
  else
    pool.run(work);
}

Segment packed_segment(const PackedWeight& W, float* y, int64_t ldy) {
  if (W.empty()) fail(ErrorKind::invalid_input, "matmul: empty PackedWeight");
  if (W.layout() != PackedLayout::panels)
    fail(ErrorKind::unsupported,
         "matmul: a {} x {} weight packed as bf16 pairs (for linear_backward_input_packed)", W.rows(),
         W.cols());
  return Segment{W.rows(), W.panel(0), W.panel_bytes(), nullptr, 0, W.dtype(), y, ldy};
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

size_t MatmulScratch::bytes() const {
  size_t n = bufs_.capacity() * sizeof(Buf);
  for (const Buf& b : bufs_) n += b.size;
  return n;
}

bool matmul_supports(DType type) {
  switch (type) {
    case DType::f32:
    case DType::f16:
    case DType::bf16:
    case DType::nf4:
    case DType::i8_ch:
    case DType::q4_0:
    case DType::q4_1:
    case DType::q5_0:
    case DType::q5_1:
    case DType::q8_0:
    case DType::q2_k:
    case DType::q3_k:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k:
    case DType::iq4_nl:
    case DType::iq4_xs:
    case DType::iq2_xxs:
    case DType::iq2_xs:
    case DType::iq2_s:
    case DType::iq3_xxs:
    case DType::iq3_s:
    case DType::iq1_s:
    case DType::iq1_m:
    case DType::tq1_0:
    case DType::tq2_0:
    case DType::q1_0:
    case DType::q2_0:
    case DType::mxfp4:
    case DType::nvfp4:
      return true;
    default:
      return false;
  }
}

size_t packed_panel_stride(DType type, int64_t K) { return panel_stride(type, K); }

PackedWeight PackedWeight::pack(const Tensor& W, ThreadPool* pool, const char* name, PackedWeight* recycle,
                                HugePageArena* arena) {
  return pack_concat(std::span<const Tensor>(&W, 1), pool, name, recycle, arena);
}

PackedWeight PackedWeight::allocate(PackedLayout layout, DType dtype, int64_t rows, int64_t cols,
                                    size_t panel_bytes, PackedWeight* recycle, HugePageArena* arena) {
  PackedWeight pw;
  pw.layout_ = layout;
  pw.dtype_ = dtype;
  pw.n_ = rows;
  pw.k_ = cols;
  pw.panel_bytes_ = panel_bytes;
  pw.n_panels_ = static_cast<size_t>((rows + kPanelRows - 1) / kPanelRows);
  const size_t bytes = pw.n_panels_ * pw.panel_bytes_;
  if (recycle && recycle->data_ && recycle->nbytes() == bytes) {
    pw.data_ = std::move(recycle->data_);
  } else if (arena != nullptr) {
    HugePageArena::Piece piece = arena->allocate(bytes);
    pw.data_ = std::shared_ptr<uint8_t>(std::move(piece.chunk), piece.data);  // aliases the chunk
  } else {
    pw.data_ = std::shared_ptr<uint8_t>(alloc_aligned(bytes).release(), AlignedFree{});
  }
  return pw;
}

PackedWeight PackedWeight::pack_concat(std::span<const Tensor> parts, ThreadPool* pool, const char* name,
                                       PackedWeight* recycle, HugePageArena* arena) {
  if (parts.empty()) fail(ErrorKind::invalid_input, "matmul: no tensors to pack for '{}'", name);
  int64_t N = 0;
  for (const Tensor& W : parts) {
    check_weight(W, name);
    if (W.dtype != parts[0].dtype || W.cols() != parts[0].cols())
      fail(ErrorKind::invalid_input,
           "matmul: '{}' stacks tensors of different type or width ({} {} vs {} {})", name,
           dtype_name(W.dtype), W.shape_string(), dtype_name(parts[0].dtype), parts[0].shape_string());
    N += W.rows();
  }
  PackedWeight pw = allocate(PackedLayout::panels, cpu::matmul_panel_type(parts[0].dtype), N, parts[0].cols(),
                             panel_stride(parts[0].dtype, parts[0].cols()), recycle, arena);
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
      cpu::pack_panel(parts[0].dtype, rp, rows, pw.k_, dst);
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

bool amx_available() { return cpu_features().amx_int8 && amx_tile_state_granted(); }

int decode_panels_quant(const CpuFeatures& f) {
  return f.avx512fp16 || (f.avxvnni && !f.has_avx512_kernels()) ? kMaxDecodePanelsQuant : 1;
}

// bf16_dot() is fma wherever AVX512-BF16 is absent or masked.
bool bf16_native(Isa isa) { return isa != Isa::avx2 && bf16_dot() == Bf16Dot::vdpbf16ps; }

// i8_ch has no AMX-INT8 kernel (it was written on a machine without AMX to test
// one on): with Isa::amx it runs the AVX-512 VNNI kernel.
bool amx_supports(DType type) {
  return type == DType::q4_0 || type == DType::q4_1 || type == DType::q5_0 || type == DType::q5_1 ||
         type == DType::q8_0;
}

void matmul_isa(Isa isa, ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y,
                int64_t ldy, int64_t T, MatmulScratch& scratch) {
  const Segment seg = packed_segment(W, y, ldy);
  run_matmul(isa, pool, W.dtype(), W.cols(), std::span<const Segment>(&seg, 1), x, ldx, T, scratch);
}

void matmul_isa(Isa isa, ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y,
                int64_t ldy, int64_t T, MatmulScratch& scratch) {
  check_weight(W, "W");
  const Segment seg{W.rows(),
                    nullptr,
                    panel_stride(W.dtype, W.cols()),
                    static_cast<const uint8_t*>(W.data),
                    W.row_bytes(),
                    W.dtype,
                    y,
                    ldy};
  run_matmul(isa, pool, cpu::matmul_panel_type(W.dtype), W.cols(), std::span<const Segment>(&seg, 1), x, ldx,
             T, scratch);
}

void matmul_multi_isa(Isa isa, ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, int64_t ldx,
                      int64_t T, MatmulScratch& scratch) {
  constexpr size_t kMax = 16;
  if (outs.empty()) return;
  if (outs.size() > kMax)
    fail(ErrorKind::invalid_input, "matmul_multi: {} weights, at most {}", outs.size(), kMax);
  const PackedWeight& W0 = *outs[0].W;
  for (size_t i = 0; i < outs.size(); ++i)
    if (outs[i].W->cols() != W0.cols())
      fail(ErrorKind::invalid_input, "matmul_multi: weight {} is {} x {}, weight 0 is {} x {}: widths differ", i,
           outs[i].W->rows(), outs[i].W->cols(), W0.rows(), W0.cols());
  // Real GGUF files mix types inside a layer (Q4_K_M keeps attn_v in q6_k, and
  // rows that are not a multiple of 256 fall back to q5_0/q8_0), and adapters
  // merge into f32 copies of some matrices only. Weights of one dtype share one
  // activation quantization and one dispatch; each dtype group runs on its own.
  // Each result is still bit-identical to its own matmul call.
  bool done[kMax] = {};
  for (size_t i = 0; i < outs.size(); ++i) {
    if (done[i]) continue;
    const DType type = outs[i].W->dtype();
    Segment segs[kMax];
    size_t n = 0;
    for (size_t j = i; j < outs.size(); ++j) {
      if (done[j] || outs[j].W->dtype() != type) continue;
      const PackedWeight& W = *outs[j].W;
      segs[n++] = packed_segment(W, outs[j].y, outs[j].ldy < 0 ? W.rows() : outs[j].ldy);
      done[j] = true;
    }
    run_matmul(isa, pool, type, W0.cols(), std::span<const Segment>(segs, n), x, ldx, T, scratch);
  }
}

}  // namespace cpu

namespace {
// LOOM_CPU=avx2 (checked by use_avx512_kernels) forces AVX2; LOOM_CPU=avx512
// keeps AVX-512 but leaves AMX unused.
cpu::Isa default_isa() {
  if (!use_avx512_kernels()) return cpu::Isa::avx2;
  return use_amx_kernels() && cpu::amx_available() ? cpu::Isa::amx : cpu::Isa::avx512;
}
}  // namespace

void matmul(ThreadPool& pool, const PackedWeight& W, const float* x, int64_t ldx, float* y, int64_t ldy,
            int64_t T, MatmulScratch& scratch) {
  cpu::matmul_isa(default_isa(), pool, W, x, ldx, y, ldy, T, scratch);
}

void matmul(ThreadPool& pool, const Tensor& W, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t T,
            MatmulScratch& scratch) {
  cpu::matmul_isa(default_isa(), pool, W, x, ldx, y, ldy, T, scratch);
}

void matmul_multi(ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, int64_t ldx, int64_t T,
                  MatmulScratch& scratch) {
  cpu::matmul_multi_isa(default_isa(), pool, outs, x, ldx, T, scratch);
}

}  // namespace loom
