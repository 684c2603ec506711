// The steady-state training step allocates nothing: this executable replaces
// malloc (and so operator new, aligned_alloc, every std::vector) with a
// counting wrapper over glibc's own, and counts every allocation on every
// thread while steps run. Its own executable: the unit tests keep the real malloc.
// LOOM_ALLOC_TRACE=1 prints a backtrace of each allocation counted (to find one).
#include <execinfo.h>
#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "train/trainer.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

namespace {

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocs{0}, g_bytes{0}, g_live{0}, g_largest{0};
bool g_trace = false;
thread_local bool t_in_trace = false;

// Every block's usable size counts into g_live while counting, so blocks
// allocated and freed inside the counted span cancel out.
void* counted(void* p) {
  if (p == nullptr || !g_counting.load(std::memory_order_relaxed)) return p;
  const auto bytes = static_cast<int64_t>(malloc_usable_size(p));
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(bytes, std::memory_order_relaxed);
  g_live.fetch_add(bytes, std::memory_order_relaxed);
  for (int64_t m = g_largest.load(); bytes > m && !g_largest.compare_exchange_weak(m, bytes);) {
  }
  if (g_trace && !t_in_trace) {
    t_in_trace = true;
    void* frames[24];
    const int n = backtrace(frames, 24);
    char head[64];
    const int len = std::snprintf(head, sizeof head, "--- allocation of %lld bytes\n", static_cast<long long>(bytes));
    (void)!write(2, head, static_cast<size_t>(len));
    backtrace_symbols_fd(frames, n, 2);
    t_in_trace = false;
  }
  return p;
}

void uncounted(void* p) {
  if (p != nullptr && g_counting.load(std::memory_order_relaxed))
    g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
}

}  // namespace

extern "C" {
void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t n, size_t m) { return counted(__libc_calloc(n, m)); }
void* realloc(void* p, size_t n) {
  uncounted(p);
  return counted(__libc_realloc(p, n));
}
void free(void* p) {
  uncounted(p);
  __libc_free(p);
}
void* memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void* aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
int posix_memalign(void** out, size_t a, size_t n) {
  void* p = counted(__libc_memalign(a, n));
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
}

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string src(const std::string& rel) { return std::string(LOOM_SOURCE_DIR) + "/" + rel; }

struct Counted {
  int64_t allocs, bytes, live, largest;
};

template <class F>
Counted count_allocations(F&& f) {
  g_allocs = 0;
  g_bytes = 0;
  g_live = 0;
  g_largest = 0;
  g_counting = true;
  f();
  g_counting = false;
  return {g_allocs.load(), g_bytes.load(), g_live.load(), g_largest.load()};
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("loom_alloc_test_" + std::to_string(::getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// 4 rows of one sample each (pack: false) in batches of 3: every epoch ends
// with a batch of 1 row, which must reuse the buffers of the 3-row batches.
TrainConfig tiny_config(const TempDir& tmp, const std::string& method, const std::string& backward,
                        double dropout, const std::string& extra = "", const std::string& optim_kind = "adamw") {
  const std::string yaml = fmt::format(
      "model: {}\n"
      "data:\n  train: {}\n  eval: {}\n  seq_len: 48\n  pack: false\n"
      "method: {}\n"
      "backward: {}\n"
      "lora:\n  r: 4\n  dropout: {}\n"
      "optim:\n  lr: 1e-3\n  kind: {}\n"
      "batch_size: 3\n"
      "grad_accum: 2\n"
      "steps: 40\n"
      "output_dir: {}\n"
      "seed: 5\n"
      "threads: 2\n{}",
      src("tests/fixtures/model/tiny-llama.f32.gguf"), src("tests/fixtures/train_data/text.jsonl"),
      src("tests/fixtures/train_data/eval.jsonl"), method, backward, dropout, optim_kind, (tmp.path / "out").string(),
      extra);
  return parse_train_config(yaml, "alloc.yaml");
}

// What Trainer::train_step computes, without its log records: the batches,
// forward/backward, the optimizer update and the parameters' follow-up.
void compute_step(Trainer& t, std::vector<Batch>& micro, int64_t step) {
  for (Batch& b : micro) t.loader().next(b);
  t.params().zero_grads();
  for (const Batch& b : micro)
    if (b.target_tokens > 0) t.session().forward_backward(b, 1e-3f, static_cast<uint64_t>(step));
  t.optimizer().step(t.params().params(), t.params().grads());
  t.params().after_update(t.model(), t.session(), t.backend());
}

void expect_steady_state_allocates_nothing(const std::string& method, const std::string& backward,
                                           double dropout, const std::string& extra = "",
                                           const std::string& optim_kind = "adamw") {
  TempDir tmp;
  Trainer t(tiny_config(tmp, method, backward, dropout, extra, optim_kind), nullptr);
  t.setup();
  std::vector<Batch> micro(2);
  compute_step(t, micro, 0);  // the first step sizes the workspaces' scratch
  const size_t acts = t.session().activation_bytes();
  const std::string what = method + " / " + backward;

  // The train layer's own parts allocate nothing at all.
  const Counted data = count_allocations([&] {
    for (int i = 0; i < 8; ++i) t.loader().next(micro[0]);  // 2 epochs: a 1-row batch among them
  });
  EXPECT_EQ(data.allocs, 0) << what << ": DataLoader::next(Batch&) " << data.bytes << " bytes";
  const Counted opt = count_allocations([&] {
    t.params().zero_grads();
    t.optimizer().step(t.params().params(), t.params().grads());
  });
  EXPECT_EQ(opt.allocs, 0) << what << ": zero_grads + AdamW " << opt.bytes << " bytes";

  // Evaluation's loss-only path runs in the same buffers; its first call sizes
  // what it alone uses (the token-accuracy flags of the loss chunk).
  Batch eval;
  t.loader().next(eval);
  t.session().forward_loss(eval);

  // Steps 2..12 with an evaluation between them allocate nothing at all: the
  // activations, the backward's buffers and every kernel's scratch (training
  // attention, weight gradients, full fine-tuning's repacked W^T) were sized
  // by TrainSession::reserve or the first step.
  const Counted c = count_allocations([&] {
    for (int64_t s = 1; s < 12; ++s) {  // 3 epochs: short last batches included
      compute_step(t, micro, s);
      if (s == 6) t.session().forward_loss(eval);
    }
  });
  EXPECT_EQ(c.allocs, 0) << what << ": " << c.allocs << " allocations of " << c.bytes << " bytes in 11 steps"
                         << " (LOOM_ALLOC_TRACE=1 prints where)";
  EXPECT_EQ(t.session().activation_bytes(), acts);
  EXPECT_EQ(t.session().reserved_tokens(), 3 * 48);
}

TEST(StepAllocations, LoraBf16) { expect_steady_state_allocates_nothing("lora", "bf16", 0.0); }
TEST(StepAllocations, LoraF16Dropout) { expect_steady_state_allocates_nothing("lora", "f16", 0.1); }
TEST(StepAllocations, LoraInt8) { expect_steady_state_allocates_nothing("lora", "int8", 0.0); }
TEST(StepAllocations, LoraExact) { expect_steady_state_allocates_nothing("lora", "exact", 0.0); }
TEST(StepAllocations, FullF16) { expect_steady_state_allocates_nothing("full", "f16", 0.0); }
TEST(StepAllocations, FullBf16) { expect_steady_state_allocates_nothing("full", "bf16", 0.0); }
TEST(StepAllocations, FullExact) { expect_steady_state_allocates_nothing("full", "exact", 0.0); }
// optim.kind adamw8bit: the 8-bit update works in its blocks' stack buffers.
TEST(StepAllocations, FullExactAdam8bit) { expect_steady_state_allocates_nothing("full", "exact", 0.0, "", "adamw8bit"); }
// Gradient checkpointing (the tiny model's 2 layers: N = 1 recomputes layer 0)
// and bf16 records of the saved activations.
TEST(StepAllocations, LoraCheckpointingDropout) {
  expect_steady_state_allocates_nothing("lora", "bf16", 0.1, "gradient_checkpointing: 1\n");
}
TEST(StepAllocations, LoraBf16Activations) {
  expect_steady_state_allocates_nothing("lora", "bf16", 0.1, "activation_dtype: bf16\n");
}
TEST(StepAllocations, FullCheckpointingBf16) {
  expect_steady_state_allocates_nothing("full", "bf16", 0.0, "gradient_checkpointing: true\nactivation_dtype: bf16\n");
}
// precision: the LoRA operands rounded into the session's LoRA scratch; fp16's
// loss scaling (unscale, scaler update) in the step.
TEST(StepAllocations, LoraFp16PrecisionDropout) {
  expect_steady_state_allocates_nothing("lora", "bf16", 0.1, "precision: fp16\n");
}
TEST(StepAllocations, LoraBf16Precision) { expect_steady_state_allocates_nothing("lora", "bf16", 0.0, "precision: bf16\n"); }

// The whole Trainer::train_step (silent log, its records included): nothing retained.
TEST(StepAllocations, TrainStepRetainsNothing) {
  TempDir tmp;
  Trainer t(tiny_config(tmp, "lora", "bf16", 0.0), nullptr);
  t.setup();
  t.train_step();
  t.train_step();
  const Counted c = count_allocations([&] {
    for (int s = 0; s < 10; ++s) t.train_step();
  });
  EXPECT_EQ(c.live, 0) << c.allocs << " allocations, " << c.bytes << " bytes in 10 steps";
  EXPECT_LT(c.largest, static_cast<int64_t>(t.session().activation_bytes()) / t.model().config().n_layers);
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  g_trace = std::getenv("LOOM_ALLOC_TRACE") != nullptr;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
