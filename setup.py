"""The native host core (plestore.native._core), built from source with the system compiler.

optional=True: where it cannot be built, plestore installs anyway and runs its pure-Python
host path (plestore.native says so once, in a one-line warning)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "plestore.native._core",
            sources=[
                f"src/plestore/native/{name}.c"
                for name in (
                    "module", "pool", "ids", "gather", "gatherpy", "uring", "direct", "filecheck",
                    "gpudirectory", "willneed", "crc", "recode", "feedserve", "hoststep", "directpy",
                )
            ],
            depends=[f"src/plestore/native/{n}.h" for n in ("constants", "core", "pybuf", "sink")],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
