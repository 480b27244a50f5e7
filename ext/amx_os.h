// Can this process use AMX-BF16 tiles? Asked once per process; no SIMD code, any target.
#pragma once
#include <string>

namespace cllm {

struct AmxSupport {
  bool cpu = false;    // cpuid: AMX-TILE, AMX-BF16, palette 1 = 8 tiles of 16 rows x 64 bytes; XCR0 has tile state
  bool os = false;     // and the OS granted this process the tile data state (Linux arch_prctl)
  std::string reason;  // why not, when !os
};

// The first call requests the permission (process-wide, so it covers threads started later).
const AmxSupport& amx_support();

}  // namespace cllm
