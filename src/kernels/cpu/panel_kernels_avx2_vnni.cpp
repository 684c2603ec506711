// The AVX2 panel kernels (panel_kernels_avx2_impl.h) with AVX-VNNI's vpdpbusd
// for the plain block dots (built with -mavxvnni; run where the CPU has it:
// Intel's cores since Alder Lake, AMD's since Zen 5).
#define LOOM_AVX2_VNNI 1
#include "kernels/cpu/panel_kernels_avx2_impl.h"
