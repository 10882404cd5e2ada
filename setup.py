"""The one compiled part of the package: the expert cache's bookkeeping (fomoepy/experts/_cache_core.c).

Optional: without a C compiler the install goes on, and fomoepy.experts.fast_cache falls back to the
Python cache (the same decisions, more host time per step). -ffp-contract=off: the core must round as
Python does (no fused multiply-adds), so its scores and their ties match the Python policies exactly.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fomoepy.experts._cache_core",
            ["fomoepy/experts/_cache_core.c"],
            extra_compile_args=["-O2", "-std=c11", "-ffp-contract=off", "-Wall", "-Wno-missing-braces"],
            optional=True,
        )
    ]
)
