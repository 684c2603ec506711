// Choices made by instruction set: LOOM_CPU's masks, the CPU classes, and what
// each class gets (the bf16 kernel, the default backward mode), for the
// feature sets of the machines loom's users have, not only this one.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "core/cpu_features.h"
#include "kernels/cpu/attention_train.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/linear_backward.h"
#include "kernels/cpu/panel.h"
#include "train/train_step.h"

namespace loom {
namespace {

CpuFeatures avx2_cpu() {  // Haswell .. Comet Lake, Zen 1-3: no AVX-VNNI
  CpuFeatures f;
  f.avx2 = f.fma = f.f16c = true;
  return f;
}
CpuFeatures skylake_x() {  // AVX-512 without VNNI: loom's AVX-512 kernels need VNNI
  CpuFeatures f = avx2_cpu();
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = true;
  return f;
}
CpuFeatures cascade_lake() {  // VNNI without VBMI
  CpuFeatures f = skylake_x();
  f.avx512vnni = true;
  return f;
}
CpuFeatures ice_lake() {
  CpuFeatures f = cascade_lake();
  f.avx512vbmi = true;
  return f;
}
CpuFeatures zen4() {
  CpuFeatures f = ice_lake();
  f.avx512bf16 = true;
  return f;
}
CpuFeatures sapphire_rapids() {
  CpuFeatures f = zen4();
  f.avxvnni = f.avx512fp16 = f.amx_tile = f.amx_int8 = f.amx_bf16 = true;
  return f;
}
CpuFeatures alder_lake() {  // AVX2 with AVX-VNNI, no AVX-512
  CpuFeatures f = avx2_cpu();
  f.avxvnni = true;
  return f;
}
CpuFeatures zen5() {  // AVX-VNNI beside AVX-512, no AVX512-FP16
  CpuFeatures f = zen4();
  f.avxvnni = true;
  return f;
}

}  // namespace

TEST(CpuFeatures, ClassesFollowTheInstructions) {
  EXPECT_EQ(cpu_class_of(avx2_cpu()), CpuClass::avx2);
  EXPECT_EQ(cpu_class_of(skylake_x()), CpuClass::avx2);
  EXPECT_EQ(cpu_class_of(cascade_lake()), CpuClass::avx512);
  EXPECT_EQ(cpu_class_of(ice_lake()), CpuClass::avx512);
  EXPECT_EQ(cpu_class_of(zen4()), CpuClass::avx512_bf16);
  EXPECT_EQ(cpu_class_of(sapphire_rapids()), CpuClass::amx);
  CpuFeatures amx_int8_only = sapphire_rapids();  // AMX tiles but no AMX-BF16
  amx_int8_only.amx_bf16 = false;
  EXPECT_EQ(cpu_class_of(amx_int8_only), CpuClass::avx512_bf16);
}

TEST(CpuFeatures, LoomCpuMasksOnlyRemove) {
  const CpuFeatures spr = sapphire_rapids();
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "")), CpuClass::amx);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "native")), CpuClass::amx);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "avx512")), CpuClass::avx512_bf16);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "avx512-nobf16")), CpuClass::avx512);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "avx2")), CpuClass::avx2);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(spr, "avx512f")), CpuClass::avx2);  // no VNNI: AVX2 matrix kernels
  EXPECT_TRUE(mask_cpu_features(spr, "avx512f")->has_avx512_f32());
  EXPECT_FALSE(mask_cpu_features(spr, "avx512f")->avx512vnni);
  const CpuFeatures m = *mask_cpu_features(spr, "avx512-nobf16");
  EXPECT_FALSE(m.amx_tile || m.amx_int8 || m.amx_bf16 || m.avx512bf16);
  EXPECT_FALSE(m.avx512vbmi);  // Cascade Lake's instructions: the grid kernels without byte permutes
  EXPECT_TRUE(m.has_avx512_kernels());
  EXPECT_TRUE(mask_cpu_features(spr, "avx512")->avx512vbmi);
  const CpuFeatures a = *mask_cpu_features(spr, "avx2");
  EXPECT_FALSE(a.avx512f || a.avx512vnni || a.avx512bf16 || a.amx_tile);
  EXPECT_TRUE(a.avx2 && a.fma);
  EXPECT_FALSE(a.avxvnni);  // avx2: the vpmaddubsw kernels; avx2-vnni keeps AVX-VNNI's vpdpbusd
  const CpuFeatures v = *mask_cpu_features(spr, "avx2-vnni");
  EXPECT_FALSE(v.avx512f || v.avx512vnni || v.avx512bf16 || v.amx_tile);
  EXPECT_TRUE(v.avx2 && v.fma && v.avxvnni);
  EXPECT_EQ(cpu_class_of(v), CpuClass::avx2);
  EXPECT_FALSE(mask_cpu_features(avx2_cpu(), "avx2-vnni")->avxvnni);  // never added
  // A mask never adds: an Ice Lake asked for avx512 stays without BF16.
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(ice_lake(), "avx512")), CpuClass::avx512);
  EXPECT_EQ(cpu_class_of(*mask_cpu_features(avx2_cpu(), "avx512")), CpuClass::avx2);
  for (const char* mask : {"avx512", "avx512-nobf16", "avx512f", "avx2-vnni", "avx2"})
    EXPECT_FALSE(mask_cpu_features(spr, mask)->avx512fp16) << mask;  // each mask stands for a CPU without it
  EXPECT_TRUE(mask_cpu_features(spr, "native")->avx512fp16);
  EXPECT_FALSE(mask_cpu_features(spr, "avx512bf16").has_value());
  EXPECT_FALSE(mask_cpu_features(spr, "AVX2").has_value());
}

// The f32 AVX-512 kernels (training attention, weight-gradient tiles) need
// AVX-512 F/BW/VL/DQ only, so Skylake-X runs them though its matrix kernels are AVX2.
TEST(CpuFeatures, F32Avx512KernelsNeedOnlyFoundation) {
  EXPECT_FALSE(avx2_cpu().has_avx512_f32());
  EXPECT_TRUE(skylake_x().has_avx512_f32());
  EXPECT_FALSE(skylake_x().has_avx512_kernels());
  EXPECT_TRUE(ice_lake().has_avx512_f32() && ice_lake().has_avx512_kernels());
  EXPECT_FALSE(mask_cpu_features(sapphire_rapids(), "avx2")->has_avx512_f32());
}

// Decode weight streams per thread (kernels/cpu/panel.h): two on Intel's cores
// since Golden Cove (AVX512-FP16, or AVX-VNNI without AVX-512), one elsewhere.
TEST(CpuFeatures, DecodePanelsByInstructions) {
  EXPECT_EQ(cpu::decode_panels_quant(sapphire_rapids()), 2);
  EXPECT_EQ(cpu::decode_panels_quant(alder_lake()), 2);
  EXPECT_EQ(cpu::decode_panels_quant(*mask_cpu_features(sapphire_rapids(), "avx2-vnni")), 2);
  EXPECT_EQ(cpu::decode_panels_quant(*mask_cpu_features(sapphire_rapids(), "avx512")), 1);  // Zen 4's
  EXPECT_EQ(cpu::decode_panels_quant(*mask_cpu_features(sapphire_rapids(), "avx2")), 1);
  EXPECT_EQ(cpu::decode_panels_quant(zen4()), 1);
  EXPECT_EQ(cpu::decode_panels_quant(zen5()), 1);
  EXPECT_EQ(cpu::decode_panels_quant(ice_lake()), 1);
  EXPECT_EQ(cpu::decode_panels_quant(avx2_cpu()), 1);
}

TEST(CpuFeatures, Bf16KernelByInstructions) {
  EXPECT_EQ(automatic_bf16_kernel(sapphire_rapids()), Bf16Kernel::amx);
  EXPECT_EQ(automatic_bf16_kernel(zen4()), Bf16Kernel::avx512);
  EXPECT_EQ(automatic_bf16_kernel(ice_lake()), Bf16Kernel::avx2);
  EXPECT_EQ(automatic_bf16_kernel(skylake_x()), Bf16Kernel::avx2);
  EXPECT_EQ(automatic_bf16_kernel(avx2_cpu()), Bf16Kernel::avx2);
  EXPECT_EQ(automatic_bf16_kernel(*mask_cpu_features(sapphire_rapids(), "avx512")), Bf16Kernel::avx512);
}

// The measured choice per class (docs/training.md, "Backward speed by CPU").
TEST(CpuFeatures, BackwardModeByClass) {
  using cpu::Bf16Dot;
  EXPECT_EQ(backward_mode_for(CpuClass::amx, Bf16Dot::vdpbf16ps), BackwardMode::bf16);
  EXPECT_EQ(backward_mode_for(CpuClass::amx, Bf16Dot::fma), BackwardMode::bf16);  // AMX tiles, not vdpbf16ps
  EXPECT_EQ(backward_mode_for(CpuClass::avx512_bf16, Bf16Dot::vdpbf16ps), BackwardMode::bf16);  // Zen 4
  EXPECT_EQ(backward_mode_for(CpuClass::avx512_bf16, Bf16Dot::fma),
            BackwardMode::f16);  // Emerald Rapids, no AMX
  EXPECT_EQ(backward_mode_for(CpuClass::avx512, Bf16Dot::fma), BackwardMode::f16);
  EXPECT_EQ(backward_mode_for(CpuClass::avx2, Bf16Dot::fma), BackwardMode::f16);
  for (CpuClass c : {CpuClass::amx, CpuClass::avx512_bf16, CpuClass::avx512, CpuClass::avx2})
    for (Bf16Dot dot : {Bf16Dot::vdpbf16ps, Bf16Dot::fma})
      EXPECT_NE(backward_mode_for(c, dot), BackwardMode::int8)
          << cpu_class_name(c);  // int8's error is 3x bf16's
}

// This process: the automatic choices agree with its usable features.
TEST(CpuFeatures, LiveChoicesAgree) {
  const CpuFeatures& u = usable_cpu_features();
  const CpuFeatures& raw = cpu_features();
  EXPECT_LE(u.avx512f, raw.avx512f);
  EXPECT_LE(u.avx512bf16, raw.avx512bf16);
  EXPECT_LE(u.amx_bf16, raw.amx_bf16);
  EXPECT_EQ(use_avx512_kernels(), u.has_avx512_kernels());
  EXPECT_EQ(default_attention_isa() == AttnIsa::avx512, u.has_avx512_f32());
  EXPECT_EQ(use_amx_kernels(), u.has_avx512_kernels() && u.amx_tile);
  EXPECT_EQ(default_backward_mode(), backward_mode_for(cpu_class_of(u), cpu::bf16_dot()));
  EXPECT_EQ(backward_mode_from_name("auto"), default_backward_mode());
  const Bf16Kernel k = automatic_bf16_kernel(u);
  EXPECT_TRUE(bf16_kernel_available(k));
}

// The largest data or unified cache of CPU 0, as sysfs lists it (0 where it does not).
TEST(CpuFeatures, LastLevelCacheBytesIsTheDeepestCacheSysfsLists) {
  std::ifstream level("/sys/devices/system/cpu/cpu0/cache/index0/level");
  const size_t llc = last_level_cache_bytes();
  if (!level) {
    EXPECT_EQ(llc, 0u);
    return;
  }
  EXPECT_GE(llc, size_t{32} << 10) << "no cache past 32 KiB";
  size_t largest = 0;
  for (int i = 0; i < 16; ++i) {
    std::ifstream size("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    size_t kib = 0;
    if (size >> kib) largest = std::max(largest, kib << 10);  // "32768K"
  }
  EXPECT_EQ(llc, largest);
}

}  // namespace loom
