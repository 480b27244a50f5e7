"""Builds the private C++ extension(s) under ext/; everything else is in pyproject.toml."""
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

sources = sorted(glob("ext/*.cpp"))
ext_modules = [
    Pybind11Extension(
        "compiledllm._cpu_select",
        sources,
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
] if sources else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
