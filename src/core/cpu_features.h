// Run-time CPU feature detection for choosing kernel variants.
#pragma once

namespace loom {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avxvnni = false;
  bool amx_tile = false;  // the OS must still grant tile state (arch_prctl) before use
  bool amx_int8 = false;
  bool amx_bf16 = false;

  // The AVX-512 kernels need F, BW, VL and VNNI together.
  bool has_avx512_kernels() const { return avx512f && avx512bw && avx512vl && avx512vnni; }
};

const CpuFeatures& cpu_features();

// LOOM_CPU=avx2 forces the AVX2 kernels on an AVX-512 machine (tests and
// benchmarks use it to exercise both paths).
bool use_avx512_kernels();

// Linux hands out the (8 KB) AMX tile state only on request (arch_prctl); asks
// once per process and says whether it was granted. False without AMX tiles.
bool amx_tile_state_granted();

// AMX kernels may run: AVX-512 kernels are in use, the CPU has AMX tiles, the OS
// granted the tile state, and LOOM_CPU is not avx2 or avx512 (which disable AMX).
// Callers still check the AMX extension they need (amx_int8, amx_bf16).
bool use_amx_kernels();

}  // namespace loom
