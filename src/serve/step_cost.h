// Hardware-aware scheduling (`loom serve --itl-target-ms`): this machine's
// measured cost of one BatchForward step, and the prefill budget it implies.
//
// A step's time is modelled as
//   decode(R) + prefill(R + P) - prefill(R) + attend * (cached positions read)
// where decode(R) is a step of R one-token rows that each want logits,
// prefill(T) a step of one T-token chunk (without its own attention), both
// measured at a few sizes on this machine's backend and interpolated, and
// `attend` the cost of one (row, cached position) pair of attention. The
// scheduler then gives each step as many prefill tokens as keep the predicted
// step time, which every decoding sequence waits for between two tokens,
// under the target.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace loom {

class BatchForward;
class KvPool;

// What a measurement holds for; another key measures again.
struct StepCostKey {
  std::string cpu;       // the CPU's model name
  std::string cpu_mask;  // LOOM_CPU, which changes the kernels
  std::string build;     // the executable's identity
  std::string model;     // the model file's identity (path, size, mtime)
  int64_t threads = 1;
  std::string kv_dtype;
  int64_t block_size = 16;
  int64_t max_rows = 256;         // the largest step measured
  int64_t max_decode_rows = 64;   // the most decode rows measured
  std::string hash() const;       // 16 hex digits of all fields
  bool operator==(const StepCostKey&) const = default;
};

// A measured curve: ms of a step at increasing sizes, interpolated linearly
// between points and extended with the last segment's slope beyond them.
struct CostCurve {
  std::vector<int64_t> n;  // sizes, increasing, the first >= 1
  std::vector<double> ms;  // non-decreasing (made so when measured)
  double at(double size) const;  // 0 at size 0
};

struct StepCost {
  StepCostKey key;
  CostCurve decode;   // R one-token rows at position 0, each with logits
  CostCurve prefill;  // one chunk of T tokens at position 0, its attention taken out
  double attend_ms_per_kpos = 0;  // attention: ms per 1000 (row, cached position) pairs
  double seconds = 0;             // how long measuring took

  // Predicted ms of a step of `decode_rows` decode rows and `prefill_tokens`
  // prefill rows reading `attended` (row, cached position) pairs in all.
  double predict_ms(int64_t decode_rows, int64_t prefill_tokens, double attended) const;
};

// The load of a step before its prefill tokens are chosen.
struct StepLoad {
  int64_t decode_rows = 0;
  double decode_attended = 0;  // sum of the decoding sequences' cached positions
  int64_t prefill_past = 0;    // positions already cached of the first sequence to prefill
};

// The predicted ms of a step of these chunk lengths and cached positions
// (one-token chunks count as decode rows).
struct StepShape {
  int64_t decode_rows = 0, prefill_tokens = 0;
  double attended = 0;
  // Adds a chunk of `len` new tokens behind `past` cached positions.
  void add(int64_t len, int64_t past);
};

// Corrects the measured cost by what the steps actually take (other load on
// the machine, what the model leaves out): an average of actual / predicted
// over recent steps, which the budget divides the target by.
class StepCostCorrection {
 public:
  void observe(double predicted_ms, double actual_ms);  // ignores steps predicted under 1 ms
  double scale() const { return scale_; }

 private:
  double scale_ = 1;
};

// The most prefill tokens a step of `load` may take so that its predicted time
// stays within `target_ms`; never more than `cap` (the step's row limit minus
// the decode rows) and, so that prompts always progress, never fewer than
// min(min_chunk, cap) even when the decode rows alone exceed the target.
int64_t prefill_budget(const StepCost& cost, const StepLoad& load, double target_ms, int64_t cap,
                       int64_t min_chunk);

// Measures `forward`'s step times with scratch sequences in `kv` (blocks
// reserved, then released; the prefix cache is cleared after, so call it
// before serving). Steps of up to key.max_rows rows and key.max_decode_rows
// decode rows, each curve stopping at the first step over `stop_ms` (larger
// steps are then extrapolated); `vocab` for the token ids used. Takes a few
// seconds: each point is the fastest of a few runs.
StepCost measure_step_cost(BatchForward& forward, KvPool& kv, int64_t vocab, int64_t max_context,
                           const StepCostKey& key, double stop_ms);

std::string step_cost_to_json(const StepCost& cost);
// Throws invalid_input naming `path` and the field for anything but what
// step_cost_to_json writes.
StepCost step_cost_from_json(std::string_view text, const std::string& path);

// DIR/step-cost-<key hash>.json.
std::string step_cost_cache_path(const std::string& dir, const StepCostKey& key);

struct CachedStepCost {
  StepCost cost;
  std::string path;     // where it is cached; empty when there is no cache dir
  bool measured = false;  // false: read from the cache
};

// The cost for `key`: read from `dir` when a valid file of that key is there
// (unless `remeasure`), else measured and written there atomically (a cache
// that cannot be written only loses the cache). An unreadable or foreign
// cache file is measured over.
CachedStepCost load_or_measure_step_cost(BatchForward& forward, KvPool& kv, int64_t vocab, int64_t max_context,
                                         const StepCostKey& key, double stop_ms, const std::string& dir,
                                         bool remeasure);

}  // namespace loom
