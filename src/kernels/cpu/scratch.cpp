#include "kernels/cpu/scratch.h"

#include "core/error.h"

namespace loom {

float* ScratchFloats::reserve(size_t n) {
  if (n <= n_) return p_.get();
  p_.reset();  // the old block goes before the new one comes
  n_ = 0;
  auto* p = static_cast<float*>(std::aligned_alloc(64, scratch_lines(n) * sizeof(float)));
  if (p == nullptr) fail(ErrorKind::io, "out of memory allocating {} bytes of kernel scratch", n * sizeof(float));
  p_.reset(p);
  n_ = scratch_lines(n);
  return p;
}

}  // namespace loom
