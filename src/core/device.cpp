#include "core/device.h"

#include <charconv>

#include <fmt/format.h>

namespace loom {

const char* device_kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    case DeviceKind::npu: return "npu";
  }
  return "?";
}

std::optional<Device> parse_device(std::string_view name) {
  const size_t colon = name.find(':');
  const std::string_view kind = name.substr(0, colon);
  Device d;
  if (kind == "cpu") d.kind = DeviceKind::cpu;
  else if (kind == "cuda") d.kind = DeviceKind::cuda;
  else if (kind == "npu") d.kind = DeviceKind::npu;
  else return std::nullopt;
  if (colon == std::string_view::npos) return d;
  const std::string_view idx = name.substr(colon + 1);
  const auto [end, ec] = std::from_chars(idx.data(), idx.data() + idx.size(), d.index);
  if (idx.empty() || ec != std::errc() || end != idx.data() + idx.size() || d.index < 0) return std::nullopt;
  if (d.kind == DeviceKind::cpu && d.index != 0) return std::nullopt;
  return d;
}

std::string device_name(Device d) {
  if (d.is_cpu()) return "cpu";
  return fmt::format("{}:{}", device_kind_name(d.kind), d.index);
}

}  // namespace loom
