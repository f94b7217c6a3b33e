"""The bundled default model's first-start conversion (``replica.model_loader.convert_gguf``: GGUF -> a float32 Hugging
Face folder), timed with each GGUF file parsed once (``gguf_files_read_once``, the default) and as transformers does
it alone (the file parsed for the tokenizer, the config and the weights, and gguf's tensor name map built again for
every submodule). Alternating rounds in one process, each into a fresh folder; the two outputs are compared byte for
byte.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_conversion.py [--rounds 2] [--gguf PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import tempfile
import time
from pathlib import Path

from replica import model_loader


def convert(gguf_path: Path, out_dir: Path, read_once: bool) -> float:
    original = model_loader.gguf_files_read_once
    if not read_once:
        model_loader.gguf_files_read_once = contextlib.nullcontext
    try:
        start = time.perf_counter()
        model_loader.convert_gguf(gguf_path, out_dir)
        return time.perf_counter() - start
    finally:
        model_loader.gguf_files_read_once = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2 GGUF")
    args = parser.parse_args()
    gguf_path = args.gguf or model_loader.find_bundled_gguf()
    with tempfile.TemporaryDirectory() as root:
        times: dict[str, list[float]] = {"parsed once": [], "transformers alone": []}
        for round_index in range(args.rounds):
            for name, read_once in (("transformers alone", False), ("parsed once", True)):
                out_dir = Path(root) / f"{round_index}-{name.replace(' ', '-')}"
                times[name].append(convert(gguf_path, out_dir, read_once))
                print(f"round {round_index}: {name}: {times[name][-1]:.1f} s", flush=True)
        first = sorted(Path(root).iterdir())
        same = all(not filecmp.dircmp(first[0], other).diff_files for other in first[1:])
        print(f"{gguf_path.name}: outputs identical: {same}")
        for name, values in times.items():
            print(f"{name}: best {min(values):.1f} s, all {', '.join(f'{v:.1f}' for v in values)}")
        ratio = min(times["parsed once"]) / min(times["transformers alone"])
        print(f"parsed once / transformers alone (best): {ratio:.2f}x")


if __name__ == "__main__":
    main()
