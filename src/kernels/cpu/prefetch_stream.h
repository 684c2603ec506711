// Software prefetch along the byte spans a thread is about to read, in the
// order it reads them, kept a fixed distance ahead of what it has consumed.
//
// Why by hand: the server's decode rows of many adapters each read their own
// factors, short spans (1-9 KiB) at scattered addresses. The hardware
// prefetchers need a few misses to train on a stream and stop at page
// boundaries, so every span started at DRAM latency: the LoRA rows read 6.6 GB/s
// where one long stream reads 18 GB/s on the same core (AMD Zen 4). Walking the
// next spans while the current one is computed keeps the misses overlapped.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace loom {

// Source: what the stream walks, the spans in reading order; its
// `bool next(const void*& data, size_t& bytes)` gives the next span, false past
// the last. A template so that it inlines: a call inside a kernel's inner
// loop would make the compiler keep the loop's accumulators in memory.
template <typename Source>
class PrefetchStream {
 public:
  static constexpr size_t kLine = 64;
  static constexpr size_t kStep = 64;

  // Starts `distance` bytes ahead: those are requested at once.
  PrefetchStream(Source& source, size_t distance) : source_(source) { advance(distance); }

  // The reader consumed `bytes` more: request as many further bytes.
  void advance(size_t bytes) {
    credit_ += static_cast<int64_t>(bytes);
    while (credit_ > 0) {
      if (at_ >= end_ && !next_span()) return;
      _mm_prefetch(at_, _MM_HINT_T1);
      at_ += kStep;
      credit_ -= static_cast<int64_t>(kStep);
    }
  }

 private:
  bool next_span() {
    const void* data = nullptr;
    size_t bytes = 0;
    do {
      if (done_ || !source_.next(data, bytes)) {
        done_ = true;
        credit_ = 0;
        return false;
      }
    } while (bytes == 0);
    // Whole lines: from the line holding the first byte past the one holding the last.
    const auto first = reinterpret_cast<uintptr_t>(data) & ~uintptr_t{kLine - 1};
    const auto last = (reinterpret_cast<uintptr_t>(data) + bytes - 1) & ~uintptr_t{kLine - 1};
    at_ = reinterpret_cast<const char*>(first);
    end_ = reinterpret_cast<const char*>(last + kLine);
    return true;
  }

  Source& source_;
  const char* at_ = nullptr;
  const char* end_ = nullptr;
  int64_t credit_ = 0;
  bool done_ = false;
};

}  // namespace loom
