// Grow-only scratch for CPU kernels that a caller (a backend Workspace) keeps
// across calls: it reallocates only when a call needs more than it holds, so a
// caller that reuses it allocates for the largest call only, then nothing.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace loom {

class ScratchFloats {
 public:
  // At least n floats, 64-byte aligned; the old contents are not kept when it grows.
  float* reserve(size_t n);
  float* data() const { return p_.get(); }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(float); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> p_;
  size_t n_ = 0;
};

// Floats rounded up to a whole number of 64-byte lines (the regions carved out
// of one ScratchFloats stay aligned).
inline size_t scratch_lines(size_t floats) { return (floats + 15) / 16 * 16; }

}  // namespace loom
