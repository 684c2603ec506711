#include "core/huge_page_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace loom {
namespace {

constexpr size_t kPage = 4096;
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

uint8_t* map_huge_pages(size_t bytes) {
  if (bytes == 0) return nullptr;
  // Mapped with a huge page of slack, then trimmed to a 2 MiB aligned start:
  // only aligned pieces can be huge pages.
  constexpr size_t kHuge = HugePageBuffer::kHugePage;
  const size_t want = round_up(bytes, kPage), span = want + kHuge;
  void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) fail(ErrorKind::io, "out of memory mapping {} bytes: {}", bytes, std::strerror(errno));
  auto* base = static_cast<uint8_t*>(m);
  auto* aligned = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(base), kHuge));
  if (aligned > base) ::munmap(base, static_cast<size_t>(aligned - base));
  const size_t after = static_cast<size_t>(base + span - (aligned + want));
  if (after > 0) ::munmap(aligned + want, after);
  // Advice only: a kernel without THP refuses it and the pages stay 4 KiB.
  const size_t whole = want / kHuge * kHuge;
  if (whole > 0) ::madvise(aligned, whole, MADV_HUGEPAGE);
  return aligned;
}

void unmap_huge_pages(uint8_t* p, size_t bytes) {
  if (p != nullptr) ::munmap(p, round_up(bytes, kPage));
}

HugePageBuffer::HugePageBuffer(size_t bytes) : data_(map_huge_pages(bytes)), size_(bytes) {}

HugePageBuffer::~HugePageBuffer() { release(); }

HugePageBuffer::HugePageBuffer(HugePageBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

HugePageBuffer& HugePageBuffer::operator=(HugePageBuffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void HugePageBuffer::release() {
  unmap_huge_pages(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

HugePageArena::HugePageArena(size_t chunk_bytes)
    : chunk_bytes_(round_up(chunk_bytes, HugePageBuffer::kHugePage)) {}

HugePageArena::Piece HugePageArena::allocate(size_t bytes) {
  constexpr size_t kAlign = 64;
  const size_t need = round_up(bytes > 0 ? bytes : 1, kAlign);
  if (need > chunk_bytes_ / 4) {
    auto own = std::make_shared<HugePageBuffer>(need);
    uint8_t* data = own->data();
    return {std::move(own), data};
  }
  std::lock_guard lock(mu_);
  if (!current_ || used_ + need > current_->size()) {
    current_ = std::make_shared<HugePageBuffer>(chunk_bytes_);
    used_ = 0;
  }
  uint8_t* data = current_->data() + used_;
  used_ += need;
  return {current_, data};
}

}  // namespace loom
