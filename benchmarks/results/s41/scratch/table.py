"""Ours / vLLM from vs_vllm.sh vllm-client's raw files, one line per tag and dtype:
python3 benchmarks/results/s41/scratch/table.py TAG [TAG ...]   (e.g. -s41c32 -s41c32w)"""
import json
import sys
from pathlib import Path

RAW = Path(__file__).resolve().parents[3] / "results" / "raw"
for tag in sys.argv[1:]:
    for dtype in ("bfloat16", "float32"):
        files = {(server, extra): RAW / dtype / f"vllm-client-{server}{tag}{extra}.json"
                 for server in ("prefixserve", "vllm") for extra in ("", "-overhead")}
        if not all(path.exists() for path in files.values()):
            continue
        (ours, ours_o), (theirs, theirs_o) = ((json.loads(files[(s, "")].read_text()),
                                               json.loads(files[(s, "-overhead")].read_text()))
                                              for s in ("prefixserve", "vllm"))
        cell = lambda a, b: f"{a / b:.2f}x ({a:.2f} / {b:.2f})"
        print(tag, dtype, "| throughput", cell(ours["request_throughput"], theirs["request_throughput"]),
              "| TTFT", cell(ours["median_ttft_ms"], theirs["median_ttft_ms"]),
              "| TPOT", cell(ours["median_tpot_ms"], theirs["median_tpot_ms"]),
              "| short", cell(ours_o["short_request_ms"], theirs_o["short_request_ms"]))
