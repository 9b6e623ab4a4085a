"""The one piece of the build pyproject.toml cannot say: the optional C accelerator of the prefix
key chain (tenantkv/_prefix_chain.c). ``optional=True``: where no C compiler is at hand the
install still succeeds and tenantkv.prefix computes the same keys in Python, only slower."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tenantkv._prefix_chain",
            sources=["tenantkv/_prefix_chain.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
