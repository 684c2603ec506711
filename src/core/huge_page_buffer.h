// Anonymous memory whose whole 2 MiB pieces the kernel is asked to back with
// transparent huge pages (madvise MADV_HUGEPAGE; Linux's default THP mode
// "madvise" gives them only when asked).
//
// Why: data read as many short spans at scattered addresses (the server's
// LoRA factors, each decode row its own adapter) pays a TLB miss per 4 KiB
// page; with 2 MiB pages those walks go away (measured on AMD Zen 4: 9 KiB
// spans at random offsets of 256 MiB read 9.1 GB/s against 7.5, 20 against 13
// with software prefetch). The tail past the last whole 2 MiB stays in 4 KiB
// pages, so no more memory is committed than the bytes asked for, rounded up
// to 4 KiB. Where THP is off, this is plain zeroed anonymous memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

namespace loom {

// The memory under HugePageBuffer, for owners of their own: `bytes` (rounded up
// to 4 KiB) of zeroed anonymous memory at a 2 MiB aligned address, its whole
// 2 MiB pieces advised to THP; null for 0 bytes; throws ErrorKind::io when the
// memory cannot be had. unmap_huge_pages takes the same byte count back.
uint8_t* map_huge_pages(size_t bytes);
void unmap_huge_pages(uint8_t* p, size_t bytes);

class HugePageBuffer {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;

  HugePageBuffer() = default;
  // Zeroed; throws ErrorKind::io when the memory cannot be had.
  explicit HugePageBuffer(size_t bytes);
  ~HugePageBuffer();
  HugePageBuffer(HugePageBuffer&& o) noexcept;
  HugePageBuffer& operator=(HugePageBuffer&& o) noexcept;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release();
  uint8_t* data_ = nullptr;  // 2 MiB aligned (map_huge_pages)
  size_t size_ = 0;
};

// Memory for many long-lived arrays carved from shared huge-page chunks, so
// that arrays smaller than 2 MiB (most matrices of a small model) sit in huge
// pages too. Why: decoding streams every packed weight once per token; on an
// AMD Zen 4, SmolLM2's 211 matrices decode 1.08-1.23x faster from huge pages
// (the same arena advised to 4 KiB pages: 0.99x the heap, so the pages, not
// the contiguity), while one 256 MiB matrix reads as fast either way
// (bench/README.md). A piece keeps its chunk alive; a chunk is returned to
// the system when its last piece is gone (freed pieces are not reused, so give
// the arena data that is allocated once and kept: weights at load).
// Thread-safe.
class HugePageArena {
 public:
  // Chunks of `chunk_bytes` (a multiple of 2 MiB); a request larger than a
  // quarter of a chunk gets a chunk of its own.
  explicit HugePageArena(size_t chunk_bytes = size_t{32} << 20);

  struct Piece {
    std::shared_ptr<HugePageBuffer> chunk;  // owns the memory
    uint8_t* data = nullptr;                // 64-byte aligned, uninitialised (zero when fresh)
  };
  Piece allocate(size_t bytes);

 private:
  size_t chunk_bytes_;
  std::mutex mu_;
  std::shared_ptr<HugePageBuffer> current_;
  size_t used_ = 0;  // bytes of current_ handed out
};

}  // namespace loom
