// Run-time CPU feature detection for choosing kernel variants. Every choice of
// a code path is made from the instructions present (after LOOM_CPU's masks),
// never from a CPU's name.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace loom {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avx512vbmi = false;  // byte permutes (vpermi2b, vpmultishiftqb): Ice Lake, Zen 4; not Cascade Lake
  bool avxvnni = false;
  // AVX512-FP16: Intel's cores since Sapphire Rapids (Golden Cove and later);
  // no AMD core up to Zen 5 has it. Read for a memory-streaming default
  // (kernels/cpu/panel.h: decode_panels_quant), no kernel uses it.
  bool avx512fp16 = false;
  bool amx_tile = false;  // in cpu_features(): the CPU has it; the OS must still grant tile state
  bool amx_int8 = false;
  bool amx_bf16 = false;

  // The AVX-512 matrix kernels (int8 dot products, bf16) need F, BW, VL and VNNI together.
  bool has_avx512_kernels() const { return avx512f && avx512bw && avx512vl && avx512vnni; }
  // The f32 AVX-512 kernels (training attention, weight-gradient tiles; files
  // *_avx512f.cpp) need F, BW, VL and DQ: Skylake-X has them, without VNNI.
  bool has_avx512_f32() const { return avx512f && avx512bw && avx512vl && avx512dq; }
};

// /proc/cpuinfo's first "model name" ("unknown" where there is none): for
// reports and cache keys, never for choosing a code path.
std::string cpu_model_name();

// The size of the largest data (or unified) cache CPU 0 has, in bytes, from
// /sys/devices/system/cpu/cpu0/cache (on AMD the L3 of one core complex, not
// the socket's sum that sysconf reports); 0 where the system does not say.
size_t last_level_cache_bytes();

// What the CPU reports (CPUID), unmasked.
const CpuFeatures& cpu_features();

// LOOM_CPU restricts the instructions loom's automatic choices may use, so one
// machine can run (and test) the paths of smaller ones:
//   avx2           no AVX-512, AMX or AVX-VNNI (Haswell .. Comet Lake, Zen 1-4)
//   avx2-vnni      AVX2 with AVX-VNNI where present, no AVX-512 or AMX (Alder Lake
//                  and later client cores, Zen 5 without AVX-512)
//   avx512f        AVX-512 F/BW/VL/DQ only: no VNNI, BF16, AMX (Skylake-X)
//   avx512-nobf16  AVX-512 with VNNI, no AVX512-BF16, VBMI or AMX (Cascade Lake;
//                  an Ice Lake also has VBMI)
//   avx512         AVX-512 with BF16 where present, no AMX (Zen 4, Cooper Lake)
//   native / unset everything the CPU has.
// Masks only remove instructions; an unknown value is nullopt.
std::optional<CpuFeatures> mask_cpu_features(const CpuFeatures& cpu, std::string_view loom_cpu);

// cpu_features() masked by LOOM_CPU (an unknown value warns once on stderr and
// masks nothing), with the AMX bits cleared unless the OS granted the tile state:
// what the automatic choices below use.
const CpuFeatures& usable_cpu_features();

// The classes of machine loom tells apart for its defaults, best first.
enum class CpuClass { amx, avx512_bf16, avx512, avx2 };
// amx: AMX-BF16 (with the AVX-512 kernels and AVX512-BF16); avx512_bf16:
// AVX-512 kernels + AVX512-BF16; avx512: AVX-512 kernels; avx2: the rest.
CpuClass cpu_class_of(const CpuFeatures& f);
const char* cpu_class_name(CpuClass c);
// cpu_class_of(usable_cpu_features()).
CpuClass cpu_class();

// usable_cpu_features().has_avx512_kernels(): LOOM_CPU=avx2 forces the AVX2
// kernels on an AVX-512 machine (tests and benchmarks use it to exercise both paths).
bool use_avx512_kernels();

// Linux hands out the (8 KB) AMX tile state only on request (arch_prctl); asks
// once per process and says whether it was granted. False without AMX tiles.
bool amx_tile_state_granted();

// AMX kernels may run: AVX-512 kernels are in use, the CPU has AMX tiles, the OS
// granted the tile state, and LOOM_CPU does not mask AMX. Callers still check
// the AMX extension they need (amx_int8, amx_bf16 in usable_cpu_features()).
bool use_amx_kernels();

}  // namespace loom
