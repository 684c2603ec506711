// --profile OUT.json for the commands that run a model (train, generate,
// bench, serve): the tracer they record into and the trace file they write
// (docs/profiling.md), with the machine's facts in otherData.loom.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "core/trace.h"
#include "model/model.h"

namespace loom::app {

// otherData.loom's common part: command, threads, cpu (model name), cpu_class,
// isa (the instructions loom's kernels choose from), plus `extra`'s fields.
nlohmann::json profile_metadata(const char* command, int threads, nlohmann::json extra = nlohmann::json::object());

// The type of the model's MLP up projection ("q4_1", "q4_k", "bf16", ...): the
// file's main type, as the report shows it.
const char* model_weight_type(const Model& model);

// The trace as Chrome Trace Event JSON (Tracer::write_chrome_json).
std::string trace_json(const Tracer& tracer, const nlohmann::json& metadata);

// Writes the trace atomically to `path` and says so on stderr (events, size).
void write_profile(const std::string& path, const Tracer& tracer, const nlohmann::json& metadata);

}  // namespace loom::app
