// Scoped MXCSR settings for kernels that must round like an instruction that
// ignores MXCSR (vdpbf16ps treats denormal inputs as zero and flushes denormal
// results): the f32 FMA kernels that emulate it run under DAZ + FTZ.
#pragma once

#include <immintrin.h>

namespace loom::cpu {
namespace {  // included by files built with different ISA flags: keep it local

class DenormalsAreZero {
 public:
  DenormalsAreZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kDaz | kFtz); }
  ~DenormalsAreZero() { _mm_setcsr(saved_); }
  DenormalsAreZero(const DenormalsAreZero&) = delete;
  DenormalsAreZero& operator=(const DenormalsAreZero&) = delete;

 private:
  static constexpr unsigned kDaz = 1u << 6, kFtz = 1u << 15;
  unsigned saved_;
};

}  // namespace
}  // namespace loom::cpu
