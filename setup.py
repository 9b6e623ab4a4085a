"""The one piece of the build pyproject.toml cannot say: the optional C accelerators of the
lookup path, the prefix key chain (tenantkv/_prefix_chain.c) and the packing of token-id lists
(tenantkv/_token_ids.c), and the CPU decoders and encoders of the latent codecs
(tenantkv/_codec_kernels.c).
``optional=True``: where no C compiler is at hand the install still succeeds, and
tenantkv.prefix, tenantkv.tokens and tenantkv.codecs do the same in Python and torch, only
slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"tenantkv.{name}",
            sources=[f"tenantkv/{name}.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
        for name in ("_prefix_chain", "_token_ids", "_codec_kernels")
    ]
)
