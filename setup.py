"""Build of her_store's one C extension, her_store._kernels._frames (LZ4 rows and crc32 runs in batches, without the GIL; crc32
by carry-less multiplication where the CPU has it, her_store/_kernels/crc32.c).

The extension is optional: where it cannot be built (no C compiler, no zlib headers) the install goes on without it,
and her_store._kernels uses the pure-Python twins of its functions (slower). Everything else about the package is in
pyproject.toml. LZ4 1.9.4 is compiled in from third_party/lz4 (BSD-2).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "her_store._kernels._frames",
            sources=["her_store/_kernels/_frames.c", "her_store/_kernels/crc32.c", "third_party/lz4/lz4.c"],
            include_dirs=["third_party/lz4"],
            libraries=["z"],  # zlib's crc32, crc32.c's fallback (the system's zlib, as Python's own)
            extra_compile_args=["-O3"],
            optional=True,  # a failed build is a warning: the package works without it (her_store._kernels.pure)
        )
    ]
)
