#include "core/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

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
    c.avx512vnni = __builtin_cpu_supports("avx512vnni");
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    // AVX-VNNI (CPUID.(7,1):EAX bit 4), AMX-BF16, AMX-TILE and AMX-INT8
    // (CPUID.(7,0):EDX bits 22, 24, 25) are read directly: not every compiler
    // knows these names in __builtin_cpu_supports (clang 14, used for the fuzz
    // build, does not).
    unsigned a = 0, b = 0, cx = 0, d = 0;
    c.avxvnni = c.avx2 && __get_cpuid_count(7, 1, &a, &b, &cx, &d) && (a & (1u << 4)) != 0;
    if (__get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
      c.amx_tile = (d & (1u << 24)) != 0;
      c.amx_int8 = (d & (1u << 25)) != 0;
      c.amx_bf16 = (d & (1u << 22)) != 0;
    }
    return c;
  }();
  return f;
}

bool use_avx512_kernels() {
  static const bool use = [] {
    const char* force = std::getenv("LOOM_CPU");
    if (force != nullptr && std::strcmp(force, "avx2") == 0) return false;
    return cpu_features().has_avx512_kernels();
  }();
  return use;
}

bool amx_tile_state_granted() {
  static const bool ok = [] {
    if (!cpu_features().amx_tile) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

bool use_amx_kernels() {
  static const bool use = [] {
    if (!use_avx512_kernels()) return false;  // also LOOM_CPU=avx2
    const char* force = std::getenv("LOOM_CPU");
    if (force != nullptr && std::strcmp(force, "avx512") == 0) return false;
    return amx_tile_state_granted();
  }();
  return use;
}

}  // namespace loom
