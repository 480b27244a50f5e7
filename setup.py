"""Builds the private C++ extension(s) under ext/; everything else is in pyproject.toml.

compiledllm._cpu_select needs only a C++17 compiler with OpenMP: the AVX-512-BF16 code is enabled
per function (target pragma) and chosen at run time, so the wheel runs on any x86-64 CPU.
-ffp-contract=off keeps both instruction-set paths bit-identical where the contract asks for it.
"""
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("CLLM_BUILD_JOBS", default=0).install()  # compile ext/*.cpp in parallel

sources = sorted(glob("ext/*.cpp"))
ext_modules = [
    Pybind11Extension(
        "compiledllm._cpu_select",
        sources,
        depends=sorted(glob("ext/*.h")),
        include_dirs=["ext"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
    )
] if sources else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
