"""Helpers for engine tests: tiny random models built in memory and transformers' own greedy generate as reference."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from replica.config import EngineConfig
from replica.engine import LLMEngine
from common.types import EngineRequest
from common.types import SamplingParams

VOCAB = 512

ARCH_CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    ),
    "qwen2": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
    ),
    # a window shorter than the prompts, so the paged read must apply it across pages
    "mistral": lambda: MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, sliding_window=200,
    ),
}


class TinyModel:
    """A random-weight model (served by the engine) and an identical copy (the reference, eager attention)."""

    def __init__(self, arch: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        config = ARCH_CONFIGS[arch]()
        self.arch = arch
        self.config = config
        self.served = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
        reference_config = copy.deepcopy(config)
        reference_config._attn_implementation = "eager"
        self.reference = AutoModelForCausalLM.from_config(reference_config, attn_implementation="eager").eval()
        self.reference.load_state_dict(self.served.state_dict())
        # the engine runs with ignore_eos: the reference must neither stop at nor suppress eos
        self.reference.generation_config.eos_token_id = None
        self._memo: dict[tuple, list[int]] = {}

    def engine(self, **overrides) -> LLMEngine:
        params = dict(num_pages=64, max_num_batched_tokens=512, max_num_seqs=16)
        params.update(overrides)
        return LLMEngine(EngineConfig(**params), self.served)

    @torch.inference_mode()
    def generate(self, prompt: list[int], num_tokens: int) -> list[int]:
        key = (tuple(prompt), num_tokens)
        if key not in self._memo:
            out = self.reference.generate(
                torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                pad_token_id=0,
            )
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int, *, check=True):
    """Submit all prompts at once, step until done (checking integrity every step); returns (tokens, outputs)."""
    for request_id, prompt in prompts.items():
        engine.add_request(EngineRequest(request_id, prompt, greedy(max_tokens)))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finals = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if check:
            engine.check_integrity()
    return tokens, finals
