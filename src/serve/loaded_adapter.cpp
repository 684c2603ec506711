// The forms a served adapter is kept in (loaded_adapter.h).
#include "serve/loaded_adapter.h"

#include "core/half.h"
#include "kernels/lora_b16.h"
#include "kernels/lora_i8.h"

namespace loom {
namespace {

// Nothing points into the f32 copies or the file any more.
void release_f32(LoadedAdapter& a) {
  a.owned.clear();
  a.tensors.pairs.clear();
  a.tensors.mapping.reset();
}

// Group of 128 columns (the fitting multiple of 32 below it for rows it does not
// divide: A's 576 take 96); B's rows of r values are one group each.
void pack_4bit(LoadedAdapter& a) {
  constexpr int64_t kGroup = 128;
  size_t n = 0;
  for (const ServeLoraPair& p : a.view.pairs) n += p.present() && p.rank() % 2 == 0 ? 2 : 0;
  a.packed.reserve(n);  // Int4Rows point into these: no reallocation
  for (ServeLoraPair& p : a.view.pairs) {
    if (!p.present()) continue;
    const int64_t r = p.rank(), in = p.a.dim(1), out = p.b.dim(0);
    // An odd rank has no 4-bit row layout here: kept in f32 (PEFT ranks are even in practice).
    if (r % 2 != 0) continue;
    const PackedInt4& qa = a.packed.emplace_back(
        pack_int4_rows(static_cast<const float*>(p.a.data), r, in, fitting_int4_group(in, kGroup)));
    const PackedInt4& qb = a.packed.emplace_back(
        pack_int4_rows(static_cast<const float*>(p.b.data), out, r, fitting_int4_group(r, kGroup)));
    p.a4 = {qa.codes.data(), qa.scales.data(), qa.group};
    p.b4 = {qb.codes.data(), qb.scales.data(), qb.group};
    p.a.data = nullptr;
    p.b.data = nullptr;
  }
  bool all_packed = true;
  for (const ServeLoraPair& p : a.view.pairs) all_packed = all_packed && (!p.present() || p.quantized());
  if (all_packed) release_f32(a);
}

// One block for the whole adapter (A then B of each pair in turn, B in
// kernels/lora_b16.h's column blocks): a pair's factors are contiguous and the
// adapter is one allocation to free.
void pack_bf16(LoadedAdapter& a) {
  size_t n = 0;
  for (const ServeLoraPair& p : a.view.pairs)
    if (p.present()) n += static_cast<size_t>(p.a.numel() + lora_b16_elements(p.b.dim(0), p.rank()));
  a.block = HugePageBuffer(n * sizeof(uint16_t));
  auto* at = reinterpret_cast<uint16_t*>(a.block.data());
  for (ServeLoraPair& p : a.view.pairs) {
    if (!p.present()) continue;
    const int64_t na = p.a.numel(), nb = lora_b16_elements(p.b.dim(0), p.rank());
    const float* fa = static_cast<const float*>(p.a.data);
    for (int64_t i = 0; i < na; ++i) at[i] = fp32_to_bf16(fa[i]);
    pack_lora_b16(static_cast<const float*>(p.b.data), p.b.dim(0), p.rank(), at + na);
    p.a16 = at;
    p.b16 = at + na;
    p.a.data = nullptr;
    p.b.data = nullptr;
    at += na + nb;
  }
  release_f32(a);
}

// The same for int8 (kernels/lora_i8.h): a pair's A (scales, codes), then its B
// (scales, codes), each from a cache line (the kernel's prefetch requests lines).
void pack_int8(LoadedAdapter& a) {
  auto align64 = [](size_t n) { return (n + 63) & ~size_t{63}; };
  size_t n = 0;
  for (const ServeLoraPair& p : a.view.pairs)
    if (p.present())
      n += align64(lora_a8_bytes(p.rank(), p.a.dim(1))) + align64(lora_b8_bytes(p.b.dim(0), p.rank()));
  a.block = HugePageBuffer(n);
  auto* at = static_cast<uint8_t*>(a.block.data());
  for (ServeLoraPair& p : a.view.pairs) {
    if (!p.present()) continue;
    const int64_t r = p.rank(), in = p.a.dim(1), out = p.b.dim(0);
    pack_lora_a8(static_cast<const float*>(p.a.data), r, in, at);
    p.a8 = at;
    at += align64(lora_a8_bytes(r, in));
    pack_lora_b8(static_cast<const float*>(p.b.data), out, r, at);
    p.b8 = at;
    at += align64(lora_b8_bytes(out, r));
    p.a.data = nullptr;
    p.b.data = nullptr;
  }
  release_f32(a);
}

}  // namespace

void keep_adapter_in_bits(LoadedAdapter& a, int lora_bits) {
  a.f32_bytes = 0;
  for (const ServeLoraPair& p : a.view.pairs)
    if (p.present()) a.f32_bytes += static_cast<size_t>(p.a.numel() + p.b.numel()) * sizeof(float);
  if (lora_bits == 4) pack_4bit(a);
  if (lora_bits == 8) pack_int8(a);
  if (lora_bits == 16) pack_bf16(a);
  a.bytes = a.view.factor_bytes();
}

}  // namespace loom
