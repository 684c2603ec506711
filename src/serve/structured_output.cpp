// The structured-output fields of a request (structured_output.h).
#include "serve/structured_output.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "serve/grammar_matcher.h"
#include "serve/json_schema_grammar.h"
#include "serve/openai_protocol.h"
#include "serve/regex_grammar.h"

namespace loom {

namespace {

using ojson = nlohmann::ordered_json;

const ojson* present(const ojson& o, const char* key) {
  const auto it = o.find(key);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

std::shared_ptr<const Grammar> compile(const std::string& gbnf, const std::string& param) {
  try {
    std::shared_ptr<Grammar> g = std::const_pointer_cast<Grammar>(compile_gbnf(gbnf));  // new, ours alone
    g->source_param = param;
    // The parses open before the first byte must fit the per-token bound (GrammarAutomaton::limit_work):
    // a 400 now rather than a choice failing once admitted.
    (void)GrammarAutomaton(g, GrammarMatcher::kTokenWork);
    return g;
  } catch (const GrammarError& e) {
    throw invalid_request(param, fmt::format("'{}': {}", param, e.what()));
  }
}

std::shared_ptr<const Grammar> from_schema(const ojson& schema, const std::string& param) {
  std::string gbnf;
  try {
    gbnf = json_schema_to_gbnf(schema);
  } catch (const SchemaError& e) {
    throw invalid_request(param, fmt::format("'{}': {}", param, e.what()));
  }
  return compile(gbnf, param);
}

std::shared_ptr<const Grammar> from_response_format(const ojson& rf) {
  const std::string param = "response_format";
  if (!rf.is_object()) throw invalid_request(param, "'response_format' must be an object");
  const ojson* type = present(rf, "type");
  if (!type || !type->is_string())
    throw invalid_request(param, "'response_format.type' must be 'text', 'json_object' or 'json_schema'");
  const std::string t = type->get<std::string>();
  if (t == "text") return nullptr;
  if (t == "json_object") {
    if (const ojson* schema = present(rf, "schema")) return from_schema(*schema, param);  // llama-server's form
    return compile(json_object_gbnf(), param);
  }
  if (t != "json_schema")
    throw invalid_request(param, fmt::format("'response_format.type' must be 'text', 'json_object' or "
                                             "'json_schema' (got '{}')",
                                             t));
  const ojson* js = present(rf, "json_schema");
  if (!js || !js->is_object()) throw invalid_request(param, "'response_format.json_schema' must be an object");
  if (const ojson* name = present(*js, "name"); name && !name->is_string())
    throw invalid_request(param, "'response_format.json_schema.name' must be a string");
  const ojson* schema = present(*js, "schema");
  if (!schema) return compile(json_object_gbnf(), param);
  return from_schema(*schema, param);
}

std::string string_field(const ojson& v, const std::string& param) {
  if (!v.is_string()) throw invalid_request(param, fmt::format("'{}' must be a string", param));
  return v.get<std::string>();
}

std::shared_ptr<const Grammar> from_choices(const ojson& v) {
  const std::string param = "guided_choice";
  if (!v.is_array() || v.empty()) throw invalid_request(param, "'guided_choice' must be a non-empty list of strings");
  std::string gbnf = "root ::= ";
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) throw invalid_request(param, fmt::format("'{}[{}]' must be a string", param, i));
    gbnf += (i ? " | " : "") + gbnf_literal(v[i].get<std::string>());
  }
  return compile(gbnf, param);
}

// vLLM's guided_regex: the whole output matches (serve/regex_grammar.h, raw text).
std::shared_ptr<const Grammar> from_regex(const std::string& pattern, const std::string& param) {
  std::string gbnf;
  try {
    gbnf = "root ::= " + regex_to_gbnf(pattern, SchemaLimits{}.max_items, RegexText::raw, "'" + param + "'") + "\n";
  } catch (const SchemaError& e) {
    throw invalid_request(param, e.what());
  }
  return compile(gbnf, param);
}

}  // namespace

std::shared_ptr<const Grammar> parse_structured_output(const nlohmann::json& body, std::string_view text) {
  static const char* const keys[] = {"response_format", "grammar",       "guided_grammar", "json_schema",
                                     "guided_json",     "guided_choice", "guided_regex"};
  std::vector<std::string> given;
  for (const char* k : keys) {
    const auto it = body.find(k);
    if (it != body.end() && !it->is_null()) given.emplace_back(k);
  }
  if (given.empty()) return nullptr;
  const ojson o = ojson::parse(text);  // parsed once already: cannot fail
  const auto is_text_format = [&] {
    const ojson* rf = present(o, "response_format");
    const ojson* type = rf && rf->is_object() ? present(*rf, "type") : nullptr;
    return type && type->is_string() && type->get<std::string>() == "text";
  };
  if (given.size() > 1 && !(given.size() == 2 && given[0] == "response_format" && is_text_format()))
    throw invalid_request(given[1], fmt::format("'{}' and '{}' cannot be used together", given[0], given[1]));
  const std::string& k = given.back();
  const ojson& v = o.at(k);
  if (k == "response_format") return from_response_format(v);
  if (k == "grammar" || k == "guided_grammar") return compile(string_field(v, k), k);
  if (k == "guided_choice") return from_choices(v);
  if (k == "guided_regex") return from_regex(string_field(v, k), k);
  // json_schema (llama-server) and guided_json (vLLM): a schema, or vLLM's schema as a JSON string.
  if (v.is_string()) {
    ojson schema;
    try {
      schema = ojson::parse(v.get<std::string>());
    } catch (const ojson::exception& e) {
      throw invalid_request(k, fmt::format("'{}' is a string that is not valid JSON: {}", k, e.what()));
    }
    return from_schema(schema, k);
  }
  return from_schema(v, k);
}

}  // namespace loom
