"""Only the compiled part of kvswap; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvswap.kernels._hostcopy", ["kernels/_hostcopy.c"],
                  extra_compile_args=["-O3"]),
        Extension("kvswap.client._ringops", ["client/_ringops.c"],
                  extra_compile_args=["-O2"]),
    ],
)
