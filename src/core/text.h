// Small string_view helpers shared by core's parsers (cgroup files, LOOM_FAILPOINTS).
#pragma once

#include <string_view>
#include <vector>

namespace loom {

// `s` without leading and trailing spaces, tabs and newlines.
std::string_view trim_blank(std::string_view s);
// `s` cut at every `sep` (an empty `s` gives one empty piece).
std::vector<std::string_view> split_on(std::string_view s, char sep);

}  // namespace loom
