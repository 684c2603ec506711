// Structured outputs of a request: response_format (OpenAI: text, json_object, json_schema), llama-server's
// "grammar" and "json_schema", vLLM's guided_json / guided_grammar / guided_choice / guided_regex, compiled into one Grammar
// on the HTTP thread so that a bad schema or grammar is a 400 before anything is queued.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string_view>

#include "serve/grammar.h"

namespace loom {

// `body` is the request as parsed; `text` the same body as sent (schemas are re-read with their key order,
// which nlohmann::json's sorted objects lose). Null when the request asks for no constraint. Throws ApiError
// 400 invalid_request_error naming the field ("response_format", "grammar", ...).
std::shared_ptr<const Grammar> parse_structured_output(const nlohmann::json& body, std::string_view text);

}  // namespace loom
