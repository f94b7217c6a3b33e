"""The result file of one run: :class:`BenchRun` (everything a run produced) and its JSON form, written with
:func:`write_json` and read back with :func:`load_result` (``prefixserve bench --result-file``, ``bench compare``).

The file holds the config, every metric and one record per request (warm-up requests too, flagged, and excluded from
the metrics); ``format_version`` is :data:`RESULT_FORMAT_VERSION`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.config import ClientConfig, LoadConfig
from bench.metrics import BenchMetrics, RequestRecord
from bench.workloads import WorkloadConfig

RESULT_FORMAT_VERSION = 1


@dataclass
class BenchRun:
    """Everything one ``prefixserve bench`` run produced."""

    label: str
    client_config: ClientConfig
    load_config: LoadConfig
    workload_config: WorkloadConfig
    prompt_format: str
    tokenizer_path: str | None
    vocab_size: int | None
    model: str
    metrics: BenchMetrics
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    started_at: str

    def to_json(self) -> dict[str, Any]:
        """The result file's content."""
        config = {
            "workload": asdict(self.workload_config),
            "num_prefixes_used": self.workload_config.effective_num_prefixes,
            "load": {**asdict(self.load_config), "request_rate": json_number(self.load_config.request_rate)},
            "client": {**asdict(self.client_config), "api_key": "***" if self.client_config.api_key else None},
            "prompt_format": self.prompt_format,
            "tokenizer": self.tokenizer_path,
            "vocab_size": self.vocab_size,
        }
        return {
            "format_version": RESULT_FORMAT_VERSION,
            "label": self.label,
            "started_at": self.started_at,
            "server": {"base_url": self.client_config.base_url, "model": self.model},
            "config": config,
            "metrics": asdict(self.metrics),
            "requests": [request_json(record) for record in self.warmup_records + self.records],
        }


def json_number(value: float) -> float | str:
    """JSON has no infinity: write it as the string "inf"."""
    return "inf" if math.isinf(value) else value


def request_json(record: RequestRecord) -> dict[str, Any]:
    """A record as JSON (with its TPOT)."""
    return {**asdict(record), "tpot_s": record.tpot_s}


def write_json(path: str, content: dict[str, Any]) -> None:
    """Write ``content`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")


def load_result(path: str) -> dict[str, Any]:
    """A result file written by ``prefixserve bench --result-file``."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
