#include "apps/profile_output.h"

#include <cstdio>
#include <sstream>

#include "core/cpu_features.h"
#include "io/file_write.h"
#include "kernels/cpu/bf16_dot.h"

namespace loom::app {
namespace {

nlohmann::json isa_list(const CpuFeatures& f) {
  nlohmann::json out = nlohmann::json::array();
  const std::pair<const char*, bool> all[] = {
      {"avx2", f.avx2},           {"fma", f.fma},           {"f16c", f.f16c},           {"avx512f", f.avx512f},
      {"avx512bw", f.avx512bw},   {"avx512vl", f.avx512vl}, {"avx512dq", f.avx512dq},   {"avx512_vnni", f.avx512vnni},
      {"avx512_bf16", f.avx512bf16}, {"avx_vnni", f.avxvnni}, {"amx_int8", f.amx_int8}, {"amx_bf16", f.amx_bf16}};
  for (const auto& [name, on] : all)
    if (on) out.push_back(name);
  return out;
}

}  // namespace

nlohmann::json profile_metadata(const char* command, int threads, nlohmann::json extra) {
  nlohmann::json m = {{"command", command},
                      {"threads", threads},
                      {"cpu", cpu_model_name()},
                      {"cpu_class", cpu_class_name(cpu_class())},
                      {"isa", isa_list(usable_cpu_features())}};
  if (usable_cpu_features().avx512bf16)  // how bf16 weights are multiplied (kernels/cpu/bf16_dot.h)
    m["bf16_dot"] = cpu::bf16_dot() == cpu::Bf16Dot::vdpbf16ps ? "vdpbf16ps" : "fma";
  if (extra.is_object())
    for (auto& [k, v] : extra.items()) m[k] = v;
  return m;
}

const char* model_weight_type(const Model& model) {
  const auto& layers = model.weights().layers;
  return layers.empty() ? "" : dtype_name(layers[0].w_up.dtype);
}

std::string trace_json(const Tracer& tracer, const nlohmann::json& metadata) {
  std::ostringstream out;
  tracer.write_chrome_json(out, metadata.dump());
  return out.str();
}

void write_profile(const std::string& path, const Tracer& tracer, const nlohmann::json& metadata) {
  const std::string text = trace_json(tracer, metadata);
  write_file_atomic(path, text);
  std::fprintf(stderr, "profile: %zu events (%.1f MiB) in %s%s; loom profile report %s\n", tracer.event_count(),
               static_cast<double>(text.size()) / (1024.0 * 1024.0), path.c_str(),
               tracer.dropped() ? " (events past the limit dropped)" : "", path.c_str());
}

}  // namespace loom::app
