"""Only the compiled part of kvswap; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvswap.kernels._hostcopy", ["kernels/_hostcopy.c"],
                  extra_compile_args=["-O3"]),
    ],
)
