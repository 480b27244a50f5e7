// AMX availability: cpuid and XCR0 say what the CPU and the kernel's XSAVE setup offer; Linux also
// wants each process to ask for the 8 KiB tile data state before its first tile instruction
// (ARCH_REQ_XCOMP_PERM), or that instruction raises SIGILL.
#include "amx_os.h"

#include <cerrno>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define CLLM_AMX_X86 1
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace cllm {
namespace {

#ifdef CLLM_AMX_X86
bool cpu_has_amx(std::string& why) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) {
    why = "the CPU does not report AMX-TILE and AMX-BF16 (cpuid 7.0 EDX bits 24, 22)";
    return false;
  }
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
    why = "no OSXSAVE";
    return false;
  }
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) {
    why = "the OS does not enable the tile state in XCR0 (bits 17, 18)";
    return false;
  }
  // Palette 1 as the kernels configure it: 8 tiles of 1 KiB, 16 rows of 64 bytes.
  if (__get_cpuid_max(0, nullptr) < 0x1D || !__get_cpuid_count(0x1D, 1, &a, &b, &c, &d) || (a >> 16) != 1024 ||
      (b & 0xFFFF) != 64 || (b >> 16) < 8 || (c & 0xFFFF) < 16) {
    why = "tile palette 1 is not 8 tiles x 16 rows x 64 bytes (cpuid 0x1D.1)";
    return false;
  }
  return true;
}

bool os_grants_tiles(std::string& why) {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) {
    why = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: ") + std::strerror(errno);
    return false;
  }
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, kGetPerm, &perm) != 0 || !(perm & (1ul << kXtileData))) {
    why = "arch_prctl(ARCH_GET_XCOMP_PERM) does not list XTILEDATA after the request";
    return false;
  }
  return true;
#else
  why = "the tile permission request is implemented for Linux only";
  return false;
#endif
}
#endif

AmxSupport probe() {
  AmxSupport s;
#ifdef CLLM_AMX_X86
  s.cpu = cpu_has_amx(s.reason);
  s.os = s.cpu && os_grants_tiles(s.reason);
#else
  s.reason = "not an x86-64 build";
#endif
  return s;
}

}  // namespace

const AmxSupport& amx_support() {
  static const AmxSupport s = probe();
  return s;
}

}  // namespace cllm
