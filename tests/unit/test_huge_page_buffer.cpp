// core/huge_page_buffer.h: zeroed, 2 MiB aligned, writable to its last byte,
// moved without copying, freed once; and, where the kernel's THP mode allows
// advice ("madvise" or "always"), advised to huge pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/huge_page_buffer.h"

namespace loom {
namespace {

// The THP mode in brackets ("always [madvise] never"), or "" without THP.
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  const auto a = s.find('['), b = s.find(']');
  return a == std::string::npos || b == std::string::npos ? "" : s.substr(a + 1, b - a - 1);
}

// The value of `field` ("VmFlags:", "AnonHugePages:") for the mapping that
// holds p, from /proc/self/smaps ("" where none).
std::string smaps_field_at(const void* p, const std::string& field) {
  std::ifstream f("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(f, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= at && at < hi;
      continue;
    }
    if (inside && line.rfind(field, 0) == 0) return line.substr(field.size());
  }
  return "";
}

TEST(HugePageBuffer, ZeroedAlignedAndWritable) {
  const size_t n = 5 * (size_t{1} << 20) + 123;  // two whole huge pages and a tail
  HugePageBuffer b(n);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % HugePageBuffer::kHugePage, 0u);
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(b.data()[i], 0) << i;
  EXPECT_EQ(b.data()[n - 1], 0);
  std::memset(b.data(), 0x5a, n);
  EXPECT_EQ(b.data()[n - 1], 0x5a);
}

TEST(HugePageBuffer, MovesOwnership) {
  HugePageBuffer a(4096);
  uint8_t* p = a.data();
  p[0] = 7;
  HugePageBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data(), p);
  HugePageBuffer c(100);
  c = std::move(b);  // c's own mapping is released
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.data()[0], 7);
  EXPECT_EQ(HugePageBuffer(0).data(), nullptr);
}

// The advice is what this code controls: the mapping carries VM_HUGEPAGE
// ("hg" in VmFlags) whether or not the kernel has a free huge page at the
// fault. Whether it had one is printed, not asserted (a fragmented machine
// may have none).
TEST(HugePageBuffer, WholePiecesAreAdvisedHugePages) {
  const std::string mode = thp_mode();
  if (mode != "madvise" && mode != "always") GTEST_SKIP() << "transparent huge pages are '" << mode << "'";
  HugePageBuffer b(3 * HugePageBuffer::kHugePage);
  std::memset(b.data(), 1, b.size());
  const std::string flags = smaps_field_at(b.data(), "VmFlags:");
  ASSERT_FALSE(flags.empty()) << "no mapping holds the buffer in /proc/self/smaps";
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << "VmFlags:" << flags;
  std::printf("AnonHugePages of the buffer:%s\n", smaps_field_at(b.data(), "AnonHugePages:").c_str());
}

// Pieces are 64-byte aligned, disjoint, carved from shared chunks (small ones)
// or their own (large ones), and keep their chunk alive after the arena is gone.
TEST(HugePageArena, PiecesAreAlignedDisjointAndKeepTheirChunk) {
  const size_t chunk = 2 * HugePageBuffer::kHugePage;
  std::vector<HugePageArena::Piece> pieces;
  std::vector<size_t> sizes = {1, 63, 64, 100000, 300000, chunk / 4, chunk / 4 + 1, 3 * chunk, 0, 777};
  {
    HugePageArena arena(chunk);
    for (size_t n : sizes) pieces.push_back(arena.allocate(n));
  }  // the arena is gone; the pieces still own their chunks
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& p = pieces[i];
    ASSERT_NE(p.data, nullptr);
    ASSERT_NE(p.chunk, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data) % 64, 0u) << i;
    EXPECT_GE(p.data, p.chunk->data());
    EXPECT_LE(p.data + std::max<size_t>(sizes[i], 1), p.chunk->data() + p.chunk->size()) << i;
    std::memset(p.data, static_cast<int>(i + 1), std::max<size_t>(sizes[i], 1));
  }
  for (size_t i = 0; i < pieces.size(); ++i) {  // no piece overwrote another
    const size_t n = std::max<size_t>(sizes[i], 1);
    for (size_t k = 0; k < n; k += std::max<size_t>(n / 16, 1))
      ASSERT_EQ(pieces[i].data[k], static_cast<uint8_t>(i + 1)) << i << " " << k;
    ASSERT_EQ(pieces[i].data[n - 1], static_cast<uint8_t>(i + 1)) << i;
  }
  EXPECT_EQ(pieces[0].chunk, pieces[1].chunk);  // small pieces share a chunk
  EXPECT_NE(pieces[6].chunk, pieces[5].chunk);  // over a quarter of a chunk: its own
  EXPECT_NE(pieces[7].chunk, pieces[6].chunk);
  EXPECT_GE(pieces[7].chunk->size(), 3 * chunk);
  EXPECT_EQ(pieces[8].chunk, pieces[9].chunk);  // back to the shared chunk after the large ones
}

// A chunk's whole 2 MiB pieces carry the huge-page advice (as HugePageBuffer).
TEST(HugePageArena, ChunksAreAdvisedHugePages) {
  const std::string mode = thp_mode();
  if (mode != "madvise" && mode != "always") GTEST_SKIP() << "transparent huge pages are '" << mode << "'";
  HugePageArena arena(4 * HugePageBuffer::kHugePage);
  HugePageArena::Piece p = arena.allocate(100000);
  std::memset(p.data, 1, 100000);
  const std::string flags = smaps_field_at(p.data, "VmFlags:");
  ASSERT_FALSE(flags.empty());
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << "VmFlags:" << flags;
}

}  // namespace
}  // namespace loom
