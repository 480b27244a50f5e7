"""The link flag that lets CUDA AOTInductor packages load where the C++ compiler links libstdc++ statically.

On the device (torch 2.11 + CUDA 13, g++ in /opt/gcc) every CUDA package died with SIGSEGV in its model's
constructor: `parse_device_str` in torch's aoti_runtime/model_base.h builds a `std::regex`, and the frames run
through libstdc++'s own code (`regex_traits::transform_primary` -> a `codecvt` member) *inside* the package's .so,
which ldd shows linking no libstdc++.so. So the .so carries a static libstdc++ whose exported symbols mix with the
process's libstdc++.so.6 (torch's) at load: half of one locale implementation calls into the other. Linking with
`--exclude-libs,ALL` keeps the static copy's symbols private to the .so, so it uses its own copy throughout; the
package talks to torch through AOTInductor's C shim, so no C++ object crosses between the two copies.

Inductor has no public setting for link flags: this adds one to the flags of `_get_optimization_cflags` for the
duration of an export and leaves Inductor untouched where that private function is missing (a newer torch).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

PRIVATE_STATIC_LIBS = "Wl,--exclude-libs,ALL"  # Inductor prefixes each link flag with "-"


@contextmanager
def private_static_libs() -> Iterator[bool]:
    """Within it, Inductor links its .so files with `-Wl,--exclude-libs,ALL`; yields whether the flag applies."""
    from torch._inductor import cpp_builder

    original = getattr(cpp_builder, "_get_optimization_cflags", None)
    if original is None or not sys.platform.startswith("linux"):
        yield False
        return

    def with_flag(*args, **kwargs):
        cflags, ldflags = original(*args, **kwargs)
        return cflags, [*ldflags, PRIVATE_STATIC_LIBS]

    cpp_builder._get_optimization_cflags = with_flag
    try:
        yield True
    finally:
        cpp_builder._get_optimization_cflags = original
