// JSON Schema -> GBNF (json_schema_grammar.h). Each sub-schema becomes a GBNF expression; objects, arrays
// and $ref targets get named rules. Every value's expression ends with `space`, so the separators around
// it need none of their own.
#include "serve/json_schema_grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "serve/grammar.h"
#include "serve/regex_grammar.h"

namespace loom {

using json = nlohmann::ordered_json;

namespace {

// The primitive rules, written once each when used.
const std::map<std::string, std::string>& primitive_rules() {
  static const std::map<std::string, std::string> rules = {
      {"space", R"(| " " | "\n" [ \t]{0,20})"},
      {"boolean", R"(("true" | "false") space)"},
      {"null", R"("null" space)"},
      {"integral-part", R"([0] | [1-9] [0-9]{0,15})"},
      {"integer", R"(("-"? integral-part) space)"},
      {"number", R"(("-"? integral-part) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})? space)"},
      {"char", R"([^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))"},
      {"string", R"("\"" char* "\"" space)"},
      {"value", R"(object | array | string | number | boolean | null)"},
      {"object", R"("{" space (string ":" space value ("," space string ":" space value)*)? "}" space)"},
      {"array", R"("[" space (value ("," space value)*)? "]" space)"},
  };
  return rules;
}

const std::map<std::string, std::vector<std::string>>& primitive_deps() {
  static const std::map<std::string, std::vector<std::string>> deps = {
      {"boolean", {"space"}},          {"null", {"space"}},
      {"integer", {"integral-part", "space"}},
      {"number", {"integral-part", "space"}},
      {"string", {"char", "space"}},
      {"value", {"object", "array", "string", "number", "boolean", "null"}},
      {"object", {"string", "value", "space"}},
      {"array", {"value", "space"}},
  };
  return deps;
}

// An integer's bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum): honoured on type "integer".
const std::set<std::string>& integer_bound_keywords() {
  static const std::set<std::string> k = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
  return k;
}

// Keywords with a meaning the grammar would silently drop: refused (the integer bounds but on "integer").
const std::set<std::string>& unsupported_keywords() {
  static const std::set<std::string> k = {
      "pattern", "patternProperties", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
      "multipleOf", "contains", "minContains", "maxContains", "not", "if", "then", "else",
      "dependentRequired", "dependentSchemas", "dependencies", "propertyNames", "minProperties",
      "maxProperties", "unevaluatedProperties", "unevaluatedItems", "additionalItems"};
  return k;
}

// Keywords that only describe (dropping them loses no constraint); everything else beside $ref, allOf,
// anyOf, oneOf, enum or const constrains the same value and is merged into it (merge below) or refused.
bool annotation(const std::string& key) {
  static const std::set<std::string> k = {"title",    "description",      "default",        "examples",
                                          "$comment", "deprecated",       "readOnly",       "writeOnly",
                                          "$id",      "$schema",          "$defs",          "definitions",
                                          "$anchor",  "contentMediaType", "contentEncoding"};
  return k.count(key) > 0;
}

// Whether a JSON value is of a JSON Schema type ("integer": a number with no fraction).
bool of_type(const json& v, const std::string& type) {
  if (type == "integer")
    return v.is_number_integer() ||
           (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>());
  if (type == "number") return v.is_number();
  if (type == "string") return v.is_string();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  return false;
}

class Converter {
 public:
  Converter(const json& root, const SchemaLimits& limits) : root_(root), lim_(limits) {}

  std::string run() {
    const std::string expr = visit(root_, "", "root", 0);
    std::string out = "root ::= " + expr + "\n";
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    return out;
  }

 private:
  [[noreturn]] void fail_at(const std::string& path, const std::string& what) const {
    throw SchemaError(fmt::format("schema{}: {}", path.empty() ? "" : " at '" + path + "'", what));
  }

  std::string use(const std::string& primitive) {
    if (rules_.count(primitive)) return primitive;
    rules_[primitive] = primitive_rules().at(primitive);
    const auto d = primitive_deps().find(primitive);
    if (d != primitive_deps().end())
      for (const auto& dep : d->second) use(dep);
    return primitive;
  }

  // A fresh rule name from a hint ("root/properties/steps" -> "steps").
  std::string rule_name(const std::string& hint) {
    std::string base;
    for (const char c : hint) base += (std::isalnum(static_cast<unsigned char>(c)) || c == '-') ? c : '-';
    if (base.empty() || base == "root") base = "item";
    if (base.size() > 40) base.resize(40);
    std::string name = base + "-r";
    for (int i = 2; rules_.count(name) || primitive_rules().count(name); ++i) name = fmt::format("{}-r{}", base, i);
    rules_[name] = "";  // reserved
    return name;
  }

  std::string visit(const json& s, const std::string& path, const std::string& hint, int depth) {
    if (depth > lim_.max_depth) fail_at(path, fmt::format("nested deeper than {} levels", lim_.max_depth));
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail_at(path, "the schema 'false' accepts no value");
      return use("value");
    }
    if (!s.is_object()) fail_at(path, "a schema must be an object or a boolean");
    const bool integer = s.contains("type") && s["type"] == "integer";
    const bool string_type = s.contains("type") && s["type"] == "string";
    for (const auto& [key, unused] : s.items())
      if (unsupported_keywords().count(key) && !(integer && integer_bound_keywords().count(key)) &&
          !(string_type && key == "pattern"))
        fail_at(path, fmt::format("'{}' is not supported{}", key,
                                  integer_bound_keywords().count(key) ? " (bounds are, on type \"integer\")"
                                  : key == "pattern"                  ? " (it is, on type \"string\")"
                                                                      : ""));
    // $ref, allOf, anyOf and oneOf: the keywords beside them constrain the same value, so they are merged
    // into the referenced schema, into allOf's, and into each alternative (an intersection).
    if (const auto it = s.find("$ref"); it != s.end()) {
      const json beside = siblings(s, "$ref");
      if (beside.empty()) return ref(*it, path, depth);
      return visit(merge(beside, resolve(*it, path), path), path, hint, depth + 1);
    }
    if (const auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->empty()) fail_at(path, "'allOf' must be a non-empty list of schemas");
      json all = siblings(s, "allOf");
      for (size_t i = 0; i < it->size(); ++i) all = merge(all, (*it)[i], fmt::format("{}/allOf/{}", path, i));
      return visit(all, path, hint, depth + 1);
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (const auto it = s.find(key); it != s.end()) {
        const json beside = siblings(s, key);
        if (beside.empty() || !it->is_array()) return alternatives(*it, path + "/" + key, hint, depth);
        json merged = json::array();  // an alternative no value of the keywords beside fits is left out
        std::string why;
        for (size_t i = 0; i < it->size(); ++i) try {
            merged.push_back(merge(beside, (*it)[i], fmt::format("{}/{}/{}", path, key, i)));
          } catch (const SchemaError& e) {
            why = e.what();
          }
        if (merged.empty()) throw SchemaError(why);
        return alternatives(merged, path + "/" + key, hint, depth);
      }
    if (s.contains("const") || s.contains("enum")) return enumeration(s, path);
    const auto type = s.find("type");
    if (type == s.end()) {
      if (s.contains("properties") || s.contains("additionalProperties")) return object(s, path, hint, depth);
      if (s.contains("items") || s.contains("prefixItems")) return array(s, path, hint, depth);
      return use("value");
    }
    if (type->is_string()) return typed(type->get<std::string>(), s, path, hint, depth);
    if (!type->is_array() || type->empty()) fail_at(path, "'type' must be a string or a non-empty list of strings");
    std::string out = "(";
    for (size_t i = 0; i < type->size(); ++i) {
      if (!(*type)[i].is_string()) fail_at(path, "'type' must be a string or a list of strings");
      out += (i ? " | " : "") + typed((*type)[i].get<std::string>(), s, path, hint, depth);
    }
    return out + ")";
  }

  std::string typed(const std::string& type, const json& s, const std::string& path, const std::string& hint,
                    int depth) {
    if (type == "object") return object(s, path, hint, depth);
    if (type == "array") return array(s, path, hint, depth);
    if (type == "string") return string(s, path);
    if (type == "integer") return integer(s, path);
    if (type == "number" || type == "boolean" || type == "null") return use(type);
    fail_at(path, fmt::format("unknown type '{}'", type));
  }

  // The schema a local $ref points at.
  const json& resolve(const json& r, const std::string& path) const {
    if (!r.is_string()) fail_at(path, "'$ref' must be a string");
    const std::string target = r.get<std::string>();
    if (target.rfind("#", 0) != 0)
      fail_at(path, fmt::format("'$ref' '{}': only local references (#/...) are supported", target));
    try {
      const json::json_pointer ptr(target.substr(1));
      if (root_.contains(ptr)) return root_.at(ptr);
    } catch (const json::exception&) {
    }
    fail_at(path, fmt::format("'$ref' '{}' does not resolve to a definition", target));
  }

  std::string ref(const json& r, const std::string& path, int depth) {
    if (r.is_string())
      if (const auto it = refs_.find(r.get<std::string>()); it != refs_.end())
        return it->second;  // recursion lands here
    const json& node = resolve(r, path);
    const std::string target = r.get<std::string>();
    const auto slash = target.rfind('/');
    const std::string name = rule_name(slash == std::string::npos ? "ref" : target.substr(slash + 1));
    refs_[target] = name;
    rules_[name] = visit(node, target.substr(1), name, depth + 1);
    return name;
  }

  // s without `key` and without annotations: what constrains the value beside `key`.
  static json siblings(const json& s, const std::string& key) {
    json out = json::object();
    for (const auto& [k, v] : s.items())
      if (k != key && !annotation(k)) out[k] = v;
    return out;
  }

  // The names of a 'type' (a string or a list).
  std::set<std::string> types(const json& t, const std::string& path) const {
    std::set<std::string> out;
    if (t.is_string()) return {t.get<std::string>()};
    if (!t.is_array() || t.empty()) fail_at(path, "'type' must be a string or a non-empty list of strings");
    for (const auto& x : t) {
      if (!x.is_string()) fail_at(path, "'type' must be a string or a list of strings");
      out.insert(x.get<std::string>());
    }
    return out;
  }

  // One schema for values that satisfy both a and b (allOf): keys of one side are taken as they are, and
  // where both give a key, 'type' and 'enum' intersect, 'required' unites, 'properties' merge property by
  // property, equal values stay; anything else both constrain differently is refused (never dropped).
  json merge(const json& a, const json& b, const std::string& path) const {
    if (b.is_boolean()) {
      if (!b.get<bool>()) fail_at(path, "the schema 'false' accepts no value");
      return a;
    }
    if (!b.is_object()) fail_at(path, "a schema must be an object or a boolean");
    json out = a;
    for (const auto& [key, v] : b.items()) {
      if (annotation(key)) continue;
      const auto it = out.find(key);
      if (it == out.end()) {
        out[key] = v;
      } else if (*it == v) {
        continue;
      } else if (key == "type") {
        std::set<std::string> both;  // integer is the number with no fraction: it meets number in itself
        const std::set<std::string> x = types(*it, path), y = types(v, path);
        for (const std::string& t : x)
          for (const std::string& u : y)
            if (t == u || (t == "integer" && u == "number") || (t == "number" && u == "integer"))
              both.insert(t == "number" ? u : t);
        if (both.empty())
          fail_at(path, fmt::format("no value is of type {} and of type {}", it->dump(), v.dump()));
        *it = both.size() == 1 ? json(*both.begin()) : json(both);
      } else if (key == "enum" && it->is_array() && v.is_array()) {
        json both = json::array();
        for (const auto& e : *it)
          if (std::find(v.begin(), v.end(), e) != v.end()) both.push_back(e);
        if (both.empty()) fail_at(path, "no value is in both 'enum' lists");
        *it = both;
      } else if (key == "required" && it->is_array() && v.is_array()) {
        for (const auto& r : v)
          if (std::find(it->begin(), it->end(), r) == it->end()) it->push_back(r);
      } else if (key == "properties" && it->is_object() && v.is_object()) {
        for (const auto& [name, sub] : v.items())
          (*it)[name] = it->contains(name) ? merge((*it)[name], sub, path + "/properties/" + name) : sub;
      } else {
        fail_at(path,
                fmt::format("'{}' is given twice with different values (beside $ref, allOf, anyOf or oneOf, "
                            "or in two allOf schemas): merging them is not supported",
                            key));
      }
    }
    return out;
  }

  // enum / const: the listed values, those of the schema's 'type' when it has one. Any other keyword
  // beside them (minLength, properties, ...) is refused rather than left unchecked.
  std::string enumeration(const json& s, const std::string& path) {
    const bool is_const = s.contains("const");
    if (is_const && s.contains("enum")) fail_at(path, "'const' together with 'enum' is not supported");
    json values = is_const ? json::array({s["const"]}) : s["enum"];
    if (!values.is_array() || values.empty()) fail_at(path, "'enum' must be a non-empty list");
    const char* key = is_const ? "const" : "enum";
    for (const auto& [k, unused] : s.items())
      if (k != key && k != "type" && !annotation(k))
        fail_at(path, fmt::format("'{}' together with '{}' is not supported", k, key));
    if (const auto t = s.find("type"); t != s.end()) {
      const std::set<std::string> allowed = types(*t, path);
      json kept = json::array();
      for (const auto& v : values)
        if (std::any_of(allowed.begin(), allowed.end(),
                        [&](const std::string& ty) { return of_type(v, ty); }))
          kept.push_back(v);
      if (kept.empty()) fail_at(path, fmt::format("no value of '{}' is of type {}", key, t->dump()));
      values = kept;
    }
    std::string out = "(";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? " | " : "") + gbnf_literal(values[i].dump());
    return out + ") " + use("space");
  }

  std::string alternatives(const json& list, const std::string& path, const std::string& hint, int depth) {
    if (!list.is_array() || list.empty()) fail_at(path, "must be a non-empty list of schemas");
    std::string out = "(";
    for (size_t i = 0; i < list.size(); ++i)
      out += (i ? " | " : "") + visit(list[i], fmt::format("{}/{}", path, i), hint, depth + 1);
    return out + ")";
  }

  int64_t count(const json& s, const char* key, int64_t def, const std::string& path) {
    const auto it = s.find(key);
    if (it == s.end()) return def;
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      fail_at(path, fmt::format("'{}' must be a non-negative integer", key));
    const auto v = it->get<int64_t>();
    if (v > lim_.max_items) fail_at(path, fmt::format("'{}' over {} is not supported", key, lim_.max_items));
    return v;
  }

  // `item` min..max times (max -1: unbounded), separated by `sep`.
  static std::string repeat(const std::string& item, const std::string& sep, int64_t min, int64_t max) {
    if (max == 0) return "";
    const std::string more = sep.empty() ? item : "(" + sep + " " + item + ")";
    const std::string tail = max < 0 ? more + "*" : max - 1 == 0 ? "" : fmt::format("{}{{0,{}}}", more, max - 1);
    if (min == 0) return "(" + item + " " + tail + ")?";
    const std::string head = min - 1 == 0 ? "" : fmt::format("{}{{{}}}", more, min - 1);
    const std::string rest = max < 0 ? tail : max > min ? fmt::format("{}{{0,{}}}", more, max - min) : "";
    return item + " " + head + " " + rest;
  }

  // type "integer": the plain rule, or with bounds the decimal spellings of exactly the integers in
  // [lo, hi] (no leading zeros, no "-0"), each side open when not given; at most 16 digits as the
  // plain rule.
  std::string integer(const json& s, const std::string& path) {
    constexpr int64_t kMax = 9'999'999'999'999'999;  // 16 nines: integral-part's longest
    const auto bound = [&](const char* key) -> std::optional<double> {
      const auto it = s.find(key);
      if (it == s.end() || it->is_boolean()) return std::nullopt;  // draft 4's exclusive flags: read below
      if (!it->is_number() || !std::isfinite(it->get<double>()))
        fail_at(path, fmt::format("'{}' must be a number", key));
      return it->get<double>();
    };
    const auto flag = [&](const char* key) { return s.contains(key) && s[key].is_boolean() && s[key].get<bool>(); };
    int64_t lo = -kMax, hi = kMax;
    const auto clamp = [&](double v) { return static_cast<int64_t>(std::clamp(v, -1e17, 1e17)); };
    if (const auto v = bound("minimum"))
      lo = std::max(lo, flag("exclusiveMinimum") ? clamp(std::floor(*v)) + 1 : clamp(std::ceil(*v)));
    if (const auto v = bound("exclusiveMinimum")) lo = std::max(lo, clamp(std::floor(*v)) + 1);
    if (const auto v = bound("maximum"))
      hi = std::min(hi, flag("exclusiveMaximum") ? clamp(std::ceil(*v)) - 1 : clamp(std::floor(*v)));
    if (const auto v = bound("exclusiveMaximum")) hi = std::min(hi, clamp(std::ceil(*v)) - 1);
    if (lo == -kMax && hi == kMax) return use("integer");
    if (lo > hi)
      fail_at(path, "no integer of at most 16 digits lies within 'minimum' / 'maximum' (or their exclusive forms)");
    std::vector<std::string> parts;
    if (lo < 0) parts.push_back("\"-\" " + unsigned_range(std::max<int64_t>(1, -std::min<int64_t>(hi, -1)), -lo));
    if (hi >= 0) parts.push_back(unsigned_range(std::max<int64_t>(lo, 0), hi));
    return "(" + (parts.size() == 1 ? parts[0] : "(" + parts[0] + ") | (" + parts[1] + ")") + ") " + use("space");
  }

  // The decimal numbers a..b (0 <= a <= b), grouped by their count of digits.
  static std::string unsigned_range(int64_t a, int64_t b) {
    std::vector<std::string> alts;
    int64_t low = 0;  // the smallest number of the current digit count
    for (int digits = 1; digits <= 16 && low <= b; ++digits) {
      const int64_t high = low == 0 ? 9 : low * 10 - 1;
      const int64_t from = std::max(a, low), to = std::min(b, high);
      if (from <= to) alts.push_back(same_length(std::to_string(from), std::to_string(to)));
      low = low == 0 ? 10 : low * 10;
    }
    std::string out;
    for (size_t i = 0; i < alts.size(); ++i) out += (i ? " | " : "") + alts[i];
    return alts.size() == 1 ? out : "(" + out + ")";
  }

  // The digit strings of one length from a to b (a <= b): the shared prefix, then at the first digit
  // that differs, a's digit followed by anything >= a's rest, the digits between followed by anything,
  // or b's digit followed by anything <= b's rest.
  static std::string same_length(const std::string& a, const std::string& b) {
    size_t i = 0;
    while (i < a.size() && a[i] == b[i]) ++i;
    const std::string prefix = i ? "\"" + a.substr(0, i) + "\" " : "";
    if (i == a.size()) return i ? "\"" + a + "\"" : "\"\"";
    const size_t rest = a.size() - i - 1;
    const auto any = [&](size_t n) { return n == 0 ? std::string() : fmt::format(" [0-9]{{{}}}", n); };
    const auto digits = [](char x, char y) { return x == y ? fmt::format("[{}]", x) : fmt::format("[{}-{}]", x, y); };
    const std::string a_rest = a.substr(i + 1), b_rest = b.substr(i + 1);
    if (a_rest == std::string(rest, '0') && b_rest == std::string(rest, '9'))
      return "(" + prefix + digits(a[i], b[i]) + any(rest) + ")";
    std::vector<std::string> alts;
    alts.push_back(digits(a[i], a[i]) + (rest ? " " + same_length(a_rest, std::string(rest, '9')) : ""));
    if (a[i] + 1 <= b[i] - 1)
      alts.push_back(digits(static_cast<char>(a[i] + 1), static_cast<char>(b[i] - 1)) + any(rest));
    alts.push_back(digits(b[i], b[i]) + (rest ? " " + same_length(std::string(rest, '0'), b_rest) : ""));
    std::string out = "(" + prefix + "(";
    for (size_t k = 0; k < alts.size(); ++k) out += (k ? " | " : "") + alts[k];
    return out + "))";
  }

  // The `format`s the grammar spells (RFC 3339 date, time and date-time; uuid), as anchored patterns; other
  // formats (email, uri, ...) are annotations, as JSON Schema's default is.
  static const char* format_pattern(const std::string& format) {
    static const std::map<std::string, const char*> formats = {
        {"date", R"(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$)"},
        {"time", R"(^([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d{1,9})?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)$)"},
        {"date-time", R"re(^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60))re"
                      R"re((\.\d{1,9})?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)$)re"},
        {"uuid", R"(^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$)"},
    };
    const auto it = formats.find(format);
    return it == formats.end() ? nullptr : it->second;
  }

  // A JSON string whose contents are `body`, then the value's trailing space.
  std::string quoted(const std::string& body) { return "\"\\\"\" " + body + " \"\\\"\" " + use("space"); }

  std::string string(const json& s, const std::string& path) {
    if (const auto it = s.find("format"); it != s.end() && it->is_string()) {
      if (const char* pattern = format_pattern(it->get<std::string>())) {
        if (s.contains("pattern") || s.contains("minLength") || s.contains("maxLength"))
          fail_at(path, fmt::format("'format' \"{}\" together with 'pattern', 'minLength' or 'maxLength' is not "
                                    "supported", it->get<std::string>()));
        return quoted(regex_to_gbnf(pattern, lim_.max_items));
      }
    }
    if (const auto it = s.find("pattern"); it != s.end()) {
      if (!it->is_string()) fail_at(path, "'pattern' must be a string");
      if (s.contains("minLength") || s.contains("maxLength"))
        fail_at(path, "'pattern' together with 'minLength' / 'maxLength' is not supported");
      use("char");  // an unanchored pattern allows any characters around its match
      try {
        return quoted(regex_to_gbnf(it->get<std::string>(), lim_.max_items));
      } catch (const SchemaError& e) {
        fail_at(path, e.what());
      }
    }
    const int64_t min = count(s, "minLength", 0, path);
    const int64_t max = count(s, "maxLength", -1, path);
    if (max >= 0 && max < min) fail_at(path, "'maxLength' is below 'minLength'");
    if (min == 0 && max < 0) return use("string");
    use("char");
    std::string chars = fmt::format("char{{{},{}}}", min, max < 0 ? std::string() : std::to_string(max));
    return quoted(chars);
  }

  std::string array(const json& s, const std::string& path, const std::string& hint, int depth) {
    const std::string name = rule_name(hint);
    std::string body = "\"[\" " + use("space") + " ";
    if (const auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array()) fail_at(path, "'prefixItems' must be a list of schemas");
      for (size_t i = 0; i < it->size(); ++i)
        body += (i ? "\",\" space " : "") + visit((*it)[i], fmt::format("{}/prefixItems/{}", path, i), hint + "-item", depth + 1) + " ";
    } else {
      const auto items = s.find("items");
      const std::string item =
          items == s.end() ? use("value") : visit(*items, path + "/items", hint + "-item", depth + 1);
      const int64_t min = count(s, "minItems", 0, path);
      const int64_t max = count(s, "maxItems", -1, path);
      if (max >= 0 && max < min) fail_at(path, "'maxItems' is below 'minItems'");
      if (const auto it = s.find("uniqueItems"); it != s.end()) {
        if (!it->is_boolean()) fail_at(path, "'uniqueItems' must be a boolean");
        if (it->get<bool>()) fail_at(path, "'uniqueItems' is not supported");
      }
      body += repeat(item, "\",\" space", min, max) + " ";
    }
    rules_[name] = body + "\"]\" space";
    return name;
  }

  std::string object(const json& s, const std::string& path, const std::string& hint, int depth) {
    const json empty = json::object();
    const auto pit = s.find("properties");
    const json& props = pit == s.end() ? empty : *pit;
    if (!props.is_object()) fail_at(path, "'properties' must be an object");
    std::set<std::string> required;
    if (const auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) fail_at(path, "'required' must be a list of strings");
      for (const auto& r : *it) {
        if (!r.is_string()) fail_at(path, "'required' must be a list of strings");
        required.insert(r.get<std::string>());
      }
    }
    const auto ait = s.find("additionalProperties");
    const bool extra = ait != s.end() && !(ait->is_boolean() && !ait->get<bool>());
    for (const auto& r : required)  // before the generic object below, which would not require it
      if (!props.contains(r)) fail_at(path, fmt::format("the required property '{}' is not in 'properties'", r));
    if (props.empty() && (ait == s.end() || (ait->is_boolean() && ait->get<bool>()))) return use("object");

    const std::string name = rule_name(hint);
    std::vector<std::pair<std::string, bool>> kvs;  // (key-value expression, required)
    for (const auto& [key, sub] : props.items()) {
      const std::string v = visit(sub, path + "/properties/" + key, key, depth + 1);
      kvs.emplace_back(gbnf_literal(json(key).dump()) + " space \":\" space " + v, required.count(key) > 0);
    }
    use("space");
    std::string extra_kv;
    if (extra) {
      const std::string v = ait->is_object() ? visit(*ait, path + "/additionalProperties", hint + "-extra", depth + 1)
                                             : use("value");
      extra_kv = use("string") + " \":\" space " + v;
    }
    rules_[name] = "\"{\" space " + members(name, kvs, extra_kv) + " \"}\" space";
    return name;
  }

  // Properties in order, required ones always, optional ones possibly left out, commas between; then any
  // extra key-values. One rule per (position, "something came before") keeps it linear in size.
  std::string members(const std::string& name, const std::vector<std::pair<std::string, bool>>& kvs,
                      const std::string& extra_kv) {
    // rest[i][first]: members from i on; `first`: nothing written yet (no comma before the next).
    std::vector<std::array<std::string, 2>> rest(kvs.size() + 1);
    const std::string extras = extra_kv.empty() ? "" : "(\",\" space " + extra_kv + ")*";
    rest[kvs.size()][0] = extras.empty() ? "" : extras;
    rest[kvs.size()][1] = extras.empty() ? "" : "(" + extra_kv + " " + extras + ")?";
    for (size_t i = kvs.size(); i-- > 0;) {
      for (int first = 0; first < 2; ++first) {
        const std::string take = (first ? "" : "\",\" space ") + kvs[i].first + " " + rest[i + 1][0];
        std::string body = kvs[i].second ? take : "(" + take + ") | (" + (rest[i + 1][first].empty() ? "\"\"" : rest[i + 1][first]) + ")";
        if (i == 0 && first == 1) {
          rest[i][first] = "(" + body + ")";
          continue;
        }
        const std::string rn = fmt::format("{}-{}{}", name, i, first ? "f" : "");
        rules_[rn] = body;
        rest[i][first] = rn;
      }
    }
    return rest[0][1];
  }

  const json& root_;
  SchemaLimits lim_;
  std::map<std::string, std::string> rules_;
  std::map<std::string, std::string> refs_;
};

// The deepest nesting of arrays and objects in `j`, walked without recursion: the converter copies
// sub-schemas (merging the keywords beside $ref, allOf, anyOf and oneOf) and nlohmann's copy recurses, so
// a request nested a million levels deep must be refused before that, not overflow the stack.
int json_depth(const json& j, int stop_past) {
  std::vector<std::pair<const json*, int>> pending = {{&j, 1}};  // (node, its depth) still to visit
  int deepest = 0;
  while (!pending.empty()) {
    const auto [node, depth] = pending.back();
    pending.pop_back();
    if (!node->is_structured()) continue;
    deepest = std::max(deepest, depth);
    if (deepest > stop_past) return deepest;
    for (const auto& child : *node) pending.emplace_back(&child, depth + 1);
  }
  return deepest;
}

}  // namespace

std::string json_schema_to_gbnf(const json& schema, const SchemaLimits& limits) {
  // Each nested schema takes two or three levels of JSON ("properties": {"a": {...}}, "items": [...]).
  const int max_json_depth = 4 * limits.max_depth + 8;
  if (json_depth(schema, max_json_depth) > max_json_depth)
    throw SchemaError(fmt::format("schema: nested deeper than {} levels of JSON", max_json_depth));
  return Converter(schema, limits).run();
}

std::string json_object_gbnf() {
  std::string out = "root ::= object\n";
  for (const char* r : {"object", "value", "array", "string", "char", "number", "integral-part", "boolean", "null", "space"})
    out += std::string(r) + " ::= " + primitive_rules().at(r) + "\n";
  return out;
}

}  // namespace loom
