// Where memory and computation live. Every Tensor and arena carries its
// Device; a Backend (kernels/backend.h) computes on one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace loom {

enum class DeviceKind : uint8_t { cpu, cuda, npu };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // which card of that kind (always 0 for the CPU)
  bool operator==(const Device&) const = default;
  bool is_cpu() const { return kind == DeviceKind::cpu; }
};

inline constexpr Device kCpu{};

const char* device_kind_name(DeviceKind k);
// "cpu", "cuda", "cuda:1", "npu", "npu:0"; nullopt for anything else.
std::optional<Device> parse_device(std::string_view name);
// "cpu", "cuda:0", ...
std::string device_name(Device d);

}  // namespace loom
