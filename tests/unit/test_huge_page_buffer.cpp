// core/huge_page_buffer.h: zeroed, 2 MiB aligned, writable to its last byte,
// moved without copying, freed once; and, where the kernel's THP mode allows
// advice ("madvise" or "always"), advised to huge pages.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

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

}  // namespace
}  // namespace loom
