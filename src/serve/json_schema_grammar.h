// JSON Schema -> GBNF, for response_format json_schema / json_object and vLLM's guided_json. The grammar
// allows bounded whitespace between tokens (at most a newline and 20 spaces or tabs, as llama.cpp's
// converter) so that a model cannot loop on blanks, and writes object properties in the schema's order.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace loom {

// A schema that cannot be turned into a grammar; the message names the place ("/properties/age").
class SchemaError : public Error {
 public:
  explicit SchemaError(const std::string& message) : Error(ErrorKind::invalid_input, message) {}
};

struct SchemaLimits {
  int max_depth = 32;        // nested schemas (objects, arrays, anyOf, $ref chains)
  int64_t max_items = 1000;  // minItems / maxItems / minLength / maxLength
};

// The GBNF of values that validate against `schema` (ordered: properties are written in the schema's order). Supported: type (one or a list), object (properties,
// required, additionalProperties false / true / a schema), array (items, prefixItems, minItems, maxItems),
// string (minLength, maxLength, or pattern: serve/regex_grammar.h; format date, time, date-time and uuid;
// other formats ignored), number, integer (minimum, maximum, exclusiveMinimum,
// exclusiveMaximum, draft 4's boolean exclusive flags too), boolean, null, enum, const, anyOf, oneOf,
// allOf of one schema, $ref to local definitions ("#/$defs/x", "#/definitions/x", recursion included).
// Keywords the grammar cannot honour (pattern but on a string, bounds on anything but an integer, multipleOf,
// uniqueItems, not, if, ...) throw SchemaError rather than produce output that may not validate.
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema, const SchemaLimits& limits = {});

// The GBNF of any JSON object (response_format json_object).
std::string json_object_gbnf();

}  // namespace loom
