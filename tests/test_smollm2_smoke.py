"""The bundled SmolLM2-135M-Instruct served by the paged engine answers a simple question sensibly."""

import asyncio

import pytest

from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import build_engine
from common.types import EngineRequest
from common.types import SamplingParams


@pytest.mark.slow
def test_default_model_answers_through_the_engine():
    engine = build_engine(EngineConfig(model=None, num_pages=32, dtype="float32"))
    system = " ".join(["You are a helpful, concise assistant who answers geography questions in one sentence."] * 12)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    async_engine = AsyncEngine(engine)

    async def ask(request_id):
        text, cached = "", None
        async for out in async_engine.generate(EngineRequest(request_id, list(prompt),
                                                             SamplingParams(max_tokens=24, temperature=0.0))):
            text += out.new_text
            cached = out.cached_tokens
        return text, cached

    try:
        first, _ = asyncio.run(ask("q1"))
        second, cached = asyncio.run(ask("q2"))
    finally:
        async_engine.shutdown()
    assert "Paris" in first
    assert second == first
    assert len(prompt) > 128 and cached.local == (len(prompt) - 1) // 128 * 128
