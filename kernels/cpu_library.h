// The torch library a kernel file registers, named for the vector ISA it was
// built for: kernels/cpu_extension.py builds each file once per ISA with
// -DAGENTKV_ISA=<isa> (avx512, avx2, native), so that two ISAs' builds of
// one kernel load side by side in one process (the tests run both).
//   AGENTKV_LIBRARY(agentkv_cpu_linear, m)        TORCH_LIBRARY(agentkv_cpu_linear_avx2, m)
//   AGENTKV_LIBRARY_IMPL(agentkv_cpu_linear, m)   its CPU implementations
//   AGENTKV_OP("agentkv_cpu_linear", "linear")    "agentkv_cpu_linear_avx2::linear"
#pragma once

#include <torch/library.h>

#ifndef AGENTKV_ISA
#error "build with -DAGENTKV_ISA=<isa> (kernels/cpu_extension.py does)"
#endif

#define AGENTKV_PASTE_(lib, isa) lib##_##isa
#define AGENTKV_NAME_(lib, isa) AGENTKV_PASTE_(lib, isa)
#define AGENTKV_TORCH_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define AGENTKV_TORCH_LIBRARY_IMPL_(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define AGENTKV_LIBRARY(lib, m) AGENTKV_TORCH_LIBRARY_(AGENTKV_NAME_(lib, AGENTKV_ISA), m)
#define AGENTKV_LIBRARY_IMPL(lib, m) AGENTKV_TORCH_LIBRARY_IMPL_(AGENTKV_NAME_(lib, AGENTKV_ISA), m)
#define AGENTKV_STR_(x) #x
#define AGENTKV_STR(x) AGENTKV_STR_(x)
#define AGENTKV_OP(lib, op) lib "_" AGENTKV_STR(AGENTKV_ISA) "::" op
