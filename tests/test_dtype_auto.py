"""``--dtype auto`` (issue 9 item 4): bfloat16 on a GPU and on CPUs that multiply bfloat16 in hardware (AMX or
AVX512-BF16), float32 on the others (where bfloat16 is emulated, ~10x slower); the start-up log's line says which and
why (``replica.engine.dtype_line``: the engine's logger, and Serve's logger in a Serve replica)."""

import pytest
import torch

from replica import engine
from replica.config import EngineConfig


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_cpu_and_the_line_says_why(monkeypatch, native):
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: native)
    config = EngineConfig(replica_id="replica-7")
    dtype, reason = engine.resolve_dtype(config)
    if native:
        assert dtype == torch.bfloat16 and reason == "auto: this CPU has native bf16 matmuls (AMX / AVX512-BF16)"
        assert engine.dtype_line(config.replica_id, dtype, reason) == f"replica replica-7 runs in bfloat16 ({reason})"
    else:
        assert dtype == torch.float32 and reason == "auto: this CPU has no native bf16 matmuls"
        assert engine.dtype_line(config.replica_id, dtype, reason) == f"replica replica-7 runs in float32 ({reason})"


def test_an_explicit_dtype_and_a_gpu_are_not_the_cpu_s_call(monkeypatch):
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: False)
    assert engine.resolve_dtype(EngineConfig(dtype="bfloat16")) == (torch.bfloat16, "--dtype bfloat16")
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: True)
    assert engine.resolve_dtype(EngineConfig(dtype="float32")) == (torch.float32, "--dtype float32")
    assert engine.resolve_dtype(EngineConfig(devices="gpu")) == (torch.bfloat16, "auto: GPU")


def test_this_cpu_s_answer_matches_its_flags():
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    assert engine.cpu_has_native_bf16() == bool(flags & {"amx_bf16", "avx512_bf16"})


def test_the_start_up_line_gives_the_whole_start_and_the_forward_s_share():
    assert (engine.startup_line("replica-7", 41.26, "compiled", 35.04)
            == "replica replica-7 started in 41.3 s, its compiled forward ready in 35.0 s")
