#include "core/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace loom {

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2");
    c.fma = __builtin_cpu_supports("fma");
    c.f16c = true;  // implied by the x86-64-v3 baseline loom is built for
    c.avx512f = __builtin_cpu_supports("avx512f");
    c.avx512bw = __builtin_cpu_supports("avx512bw");
    c.avx512vl = __builtin_cpu_supports("avx512vl");
    c.avx512dq = __builtin_cpu_supports("avx512dq");
    c.avx512vnni = __builtin_cpu_supports("avx512vnni");
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    c.avx512vbmi = __builtin_cpu_supports("avx512vbmi");
    // AVX-VNNI (CPUID.(7,1):EAX bit 4), AMX-BF16, AVX512-FP16, AMX-TILE and
    // AMX-INT8 (CPUID.(7,0):EDX bits 22, 23, 24, 25) are read directly: not every compiler
    // knows these names in __builtin_cpu_supports (clang 14, used for the fuzz
    // build, does not).
    unsigned a = 0, b = 0, cx = 0, d = 0;
    c.avxvnni = c.avx2 && __get_cpuid_count(7, 1, &a, &b, &cx, &d) && (a & (1u << 4)) != 0;
    if (__get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
      c.amx_tile = (d & (1u << 24)) != 0;
      c.amx_int8 = (d & (1u << 25)) != 0;
      c.amx_bf16 = (d & (1u << 22)) != 0;
      c.avx512fp16 = c.avx512f && (d & (1u << 23)) != 0;
    }
    return c;
  }();
  return f;
}

std::optional<CpuFeatures> mask_cpu_features(const CpuFeatures& cpu, std::string_view loom_cpu) {
  CpuFeatures f = cpu;
  if (loom_cpu.empty() || loom_cpu == "native") return f;
  if (loom_cpu != "avx2" && loom_cpu != "avx2-vnni" && loom_cpu != "avx512f" && loom_cpu != "avx512-nobf16" &&
      loom_cpu != "avx512")
    return std::nullopt;
  f.amx_tile = f.amx_int8 = f.amx_bf16 = false;
  f.avx512fp16 = false;  // every mask stands for a CPU without it (Zen 4 for avx512)
  if (loom_cpu == "avx512") return f;
  f.avx512bf16 = f.avx512vbmi = false;
  if (loom_cpu == "avx512-nobf16") return f;
  f.avx512vnni = false;
  if (loom_cpu == "avx512f") return f;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512vnni = false;
  if (loom_cpu == "avx2-vnni") return f;
  f.avxvnni = false;
  return f;
}

const CpuFeatures& usable_cpu_features() {
  static const CpuFeatures f = [] {
    const char* env = std::getenv("LOOM_CPU");
    std::optional<CpuFeatures> m = mask_cpu_features(cpu_features(), env != nullptr ? env : "");
    if (!m) {
      std::fprintf(stderr,
                   "loom: warning: LOOM_CPU=%s is not one of avx2, avx2-vnni, avx512f, avx512-nobf16, "
                   "avx512, native; ignored\n",
                   env);
      m = cpu_features();
    }
    if (m->amx_tile && !amx_tile_state_granted()) m->amx_tile = m->amx_int8 = m->amx_bf16 = false;
    return *m;
  }();
  return f;
}

CpuClass cpu_class_of(const CpuFeatures& f) {
  if (!f.has_avx512_kernels()) return CpuClass::avx2;
  if (!f.avx512bf16) return CpuClass::avx512;
  return f.amx_tile && f.amx_bf16 ? CpuClass::amx : CpuClass::avx512_bf16;
}

const char* cpu_class_name(CpuClass c) {
  switch (c) {
    case CpuClass::amx: return "AMX-BF16";
    case CpuClass::avx512_bf16: return "AVX512-BF16";
    case CpuClass::avx512: return "AVX-512 (no BF16)";
    case CpuClass::avx2: return "AVX2";
  }
  return "?";
}

CpuClass cpu_class() { return cpu_class_of(usable_cpu_features()); }

bool use_avx512_kernels() { return usable_cpu_features().has_avx512_kernels(); }

bool amx_tile_state_granted() {
  static const bool ok = [] {
    if (!cpu_features().amx_tile) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

bool use_amx_kernels() {
  const CpuFeatures& f = usable_cpu_features();
  return f.has_avx512_kernels() && f.amx_tile;
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "unknown" : line.substr(start);
  }
  return "unknown";
}

size_t last_level_cache_bytes() {
  size_t best = 0;
  int best_level = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_in(dir + "level"), type_in(dir + "type"), size_in(dir + "size");
    int level = 0;
    std::string type, size;
    if (!(level_in >> level) || !(type_in >> type) || !(size_in >> size)) continue;
    if (type != "Data" && type != "Unified") continue;
    // "32768K", "1024K", "2M": the kernel's own units.
    char* end = nullptr;
    size_t bytes = std::strtoull(size.c_str(), &end, 10);
    if (*end == 'K')
      bytes <<= 10;
    else if (*end == 'M')
      bytes <<= 20;
    else if (*end == 'G')
      bytes <<= 30;
    if (level > best_level) {
      best_level = level;
      best = bytes;
    }
  }
  return best;
}

}  // namespace loom
