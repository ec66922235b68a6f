// CPU-feature detection shared by the C++ kernels (kernels/*/cpu/*.cpp): which instruction sets this CPU offers, and
// whether Linux grants this process the AMX tile state. kernels/cpu_extension.py puts this folder on the include path
// and folds this file into each including kernel's build name, so a change here rebuilds them.
//
// Defines EM_X86 on x86-64 (the AVX-512 / AVX2 paths may be compiled, with per-function target attributes) and
// EM_AMX on x86-64 Linux (the tile paths may be compiled). Every probe runs once per process and library; each kernel
// combines the flags it needs (e.g. its bf16 path: avx512f && avx512bw && avx512bf16) and keeps its own ISA choice.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define EM_X86 1
#endif
#if defined(EM_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define EM_AMX 1
#endif

namespace em_cpu {
namespace {  // internal linkage: each extension library has its own copy, as when each carried the code

#ifdef EM_X86
struct Features {
  bool avx2, fma, avx512f, avx512bw, avx512vl, avx512bf16;
};

// The instruction sets the CPU (and the OS, for the wider register state) supports: __builtin_cpu_supports.
inline const Features& features() {
  static const Features f{__builtin_cpu_supports("avx2") != 0,     __builtin_cpu_supports("fma") != 0,
                          __builtin_cpu_supports("avx512f") != 0,  __builtin_cpu_supports("avx512bw") != 0,
                          __builtin_cpu_supports("avx512vl") != 0, __builtin_cpu_supports("avx512bf16") != 0};
  return f;
}
#endif

#ifdef EM_AMX
// AMX-TILE and AMX-BF16 in CPUID leaf 7 (EDX bits 24 and 22), and the tile data state granted: Linux gives a process
// the XTILEDATA state only on request (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18) and
// refuses where the kernel or the hypervisor does not support it. Asked once; callers ask only when AMX would run.
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}
#endif

}  // namespace
}  // namespace em_cpu
