// The AVX2 panel kernels (panel_kernels_avx2_impl.h) with vpmaddubsw/vpmaddwd
// block dots: every x86-64-v3 CPU.
#define LOOM_AVX2_VNNI 0
#include "kernels/cpu/panel_kernels_avx2_impl.h"
