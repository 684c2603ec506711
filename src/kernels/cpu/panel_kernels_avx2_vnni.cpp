// The AVX2 panel kernels (panel_kernels_avx2_impl.h) with AVX-VNNI's vpdpbusd
// for the plain block dots (built with -mavxvnni; the AVX2 path runs them where
// the CPU has AVX-VNNI: Intel's cores since Alder Lake).
#define LOOM_AVX2_VNNI 1
#include "kernels/cpu/panel_kernels_avx2_impl.h"
