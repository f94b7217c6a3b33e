"""Seeded, reproducible prompt workloads for ``prefixserve bench``.

A workload is a list of :class:`Session` objects. A session is one or more turns sent one after the other:

- ``shared-prefix``: K prefixes of P tokens; each request is one prefix (picked at random, seeded) + its own S-token
  suffix. The first request of a prefix misses, the others can reuse its pages.
- ``cross-replica``: like ``shared-prefix`` but the K prefixes are visited round-robin (request i uses prefix i mod K),
  with K chosen so that all prefixes do not fit in one replica's cache: reuse only helps if it crosses replicas (or
  tiers). ``replica_cache_tokens`` sets K = 2 x ceil(cache / P) when given.
- ``unique``: P + S fresh tokens per request, nothing shared (the no-reuse baseline with the same shape).
- ``multi-turn``: conversations of T turns; turn t resends the system prompt (one of K prefixes), every earlier user
  message and the model's earlier answers, then a new S-token user message::

      turn 0:  [system P][user 0 S]
      turn 1:  [system P][user 0 S][answer 0][user 1 S]
      turn 2:  [system P][user 0 S][answer 0][user 1 S][answer 1][user 2 S]
               \\___________ previous prompt + answer: reusable ___________/

Prompt pieces are token-id lists (``IdPromptFactory``: exact lengths, for /v1/completions) or text made of words
(``WordPromptFactory``: exact lengths when built from a tokenizer's single-token words, approximate otherwise).
Every random draw comes from ``random.Random`` seeded with a string naming what it draws (``"{seed}/prefix/{k}"``),
so the same seed gives the same prompts whatever the other settings, and prefixes do not depend on request counts.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, Union

WORKLOADS = ("shared-prefix", "multi-turn", "unique", "cross-replica")
STANDARD_WORKLOAD_NAMES = ("generated-shared-prefix", "prefix-repetition", "shared-prefix-groups", "multi-round-qa",
                           "mooncake-trace")
"""Other projects' named workloads with their published parameters (bench/standard_workloads.py)."""
PROMPT_FORMATS = ("ids", "text")
SAFE_ID_MARGIN = 100
"""Token ids are drawn from [margin, vocab_size - margin): clear of special tokens at both ends of most vocabularies."""

Prompt = Union[list[int], str]
"""A prompt piece: token ids or text. Both concatenate with ``+``."""

# A fixed vocabulary for text prompts when no tokenizer is given (lengths are then approximate: ~1 token per word).
BUILTIN_WORDS: tuple[str, ...] = tuple(
    """
    time year people way day man thing woman life child world school state family student group country problem hand
    part place case week company system program question work government number night point home water room mother
    area money story fact month lot right study book eye job word business issue side kind head house service friend
    father power hour game line end member law car city community name president team minute idea kid body information
    back parent face others level office door health person art war history party result change morning reason research
    girl guy moment air teacher force education foot boy age policy music market sense nation plan college interest
    death experience effect use class control care field development role effort rate heart drug show leader light voice
    wife police mind price report decision son view relationship town road arm difference value building action model
    season society tax director position player record paper space ground form event official matter center couple site
    project activity star table need court oil situation cost industry figure street image phone data picture practice
    piece land product doctor wall patient worker news test movie north love support technology step baby computer type
    attention film tree source organization hair window evidence population site blue green red small large early young
    """.split()
)


class PromptFactory(Protocol):
    """Makes prompt pieces of a given token length and counts the tokens of a prompt (None when it cannot)."""

    prompt_format: str

    def make(self, num_tokens: int, rng: random.Random) -> Prompt:
        """A piece of ``num_tokens`` tokens (exactly, or approximately for word prompts without a tokenizer)."""
        ...

    def count(self, prompt: Prompt) -> int | None:
        """The number of tokens of ``prompt``, or None when this factory cannot count them."""
        ...

    def empty(self) -> Prompt:
        """A zero-length piece ([] or "")."""
        ...


@dataclass(frozen=True)
class IdPromptFactory:
    """Token-id prompts with ids drawn uniformly from [SAFE_ID_MARGIN, vocab_size - SAFE_ID_MARGIN)."""

    vocab_size: int
    prompt_format: str = "ids"

    def __post_init__(self) -> None:
        if self.vocab_size < 2 * SAFE_ID_MARGIN + 1:
            raise ValueError(
                f"vocab size {self.vocab_size} leaves no safe token ids; pass --vocab-size >= {2 * SAFE_ID_MARGIN + 1}"
            )

    def make(self, num_tokens: int, rng: random.Random) -> list[int]:
        return [rng.randrange(SAFE_ID_MARGIN, self.vocab_size - SAFE_ID_MARGIN) for _ in range(num_tokens)]

    def count(self, prompt: Prompt) -> int | None:
        return len(prompt) if isinstance(prompt, list) else None

    def empty(self) -> list[int]:
        return []


@dataclass(frozen=True)
class WordPromptFactory:
    """Text prompts: ``" w1 w2 ... wn"`` (a space before every word).

    With a tokenizer, ``words`` are the tokenizer's own single-token words (:func:`single_token_words`): the tokenizer's
    pre-tokenizer splits text at each space, so n words are exactly n tokens and the tokens of a prefix's text are a
    prefix of the tokens of prefix + suffix. Without one, ``BUILTIN_WORDS`` give about one token per word.
    """

    words: tuple[str, ...] = BUILTIN_WORDS
    tokenizer: Any = None
    prompt_format: str = "text"

    def __post_init__(self) -> None:
        if not self.words:
            raise ValueError("the word vocabulary is empty; use --prompt-format ids or another --tokenizer")

    def make(self, num_tokens: int, rng: random.Random) -> str:
        return "".join(" " + rng.choice(self.words) for _ in range(num_tokens))

    def count(self, prompt: Prompt) -> int | None:
        if self.tokenizer is None or not isinstance(prompt, str):
            return None
        return len(self.tokenizer.encode(prompt, add_special_tokens=False))

    def empty(self) -> str:
        return ""


def single_token_words(tokenizer: Any, max_words: int = 4096) -> tuple[str, ...]:
    """Lower-case words ``w`` such that ``" " + w`` is exactly one token of ``tokenizer`` (in token-id order).

    Only ids in the safe range are scanned; each candidate is re-encoded to prove it round-trips.
    """
    pattern = re.compile(r"^ [a-z]{2,}$")
    words: list[str] = []
    for token_id in range(SAFE_ID_MARGIN, max(SAFE_ID_MARGIN, len(tokenizer) - SAFE_ID_MARGIN)):
        text = tokenizer.decode([token_id])
        if pattern.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(text[1:])
            if len(words) >= max_words:
                break
    return tuple(words)


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local folder (``transformers.AutoTokenizer``; never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def make_prompt_factory(prompt_format: str, vocab_size: int | None, tokenizer: Any = None) -> PromptFactory:
    """The factory for ``prompt_format`` ("ids" or "text"); the tokenizer, when given, fixes the vocabulary."""
    if prompt_format == "ids":
        size = vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer is not None else 1024)
        return IdPromptFactory(vocab_size=size)
    if prompt_format == "text":
        if tokenizer is None:
            return WordPromptFactory()
        return WordPromptFactory(words=single_token_words(tokenizer), tokenizer=tokenizer)
    raise ValueError(f"unknown prompt format {prompt_format!r}; choose one of {', '.join(PROMPT_FORMATS)}")


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate. Token lengths are in tokens; ``output_len_range`` (inclusive) overrides ``output_len``."""

    workload: str = "shared-prefix"
    num_requests: int = 40
    num_prefixes: int = 4
    prefix_len: int = 1792
    suffix_len: int = 256
    output_len: int = 32
    output_len_range: tuple[int, int] | None = None
    num_turns: int = 4
    replica_cache_tokens: int | None = None
    seed: int = 0
    standard: Any = None
    """For a ``STANDARD_WORKLOAD_NAMES`` workload: its parameters (a dataclass of bench/standard_workloads.py)."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS + STANDARD_WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of "
                             f"{', '.join(WORKLOADS + STANDARD_WORKLOAD_NAMES)}")
        if self.num_requests < 0:
            raise ValueError(f"--num-requests must be >= 0, got {self.num_requests}")
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes must be >= 1, got {self.num_prefixes}")
        if self.prefix_len < 0 or self.suffix_len < 0 or self.prefix_len + self.suffix_len < 1:
            raise ValueError("--prefix-len and --suffix-len must be >= 0 and give at least one prompt token")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if self.output_len_range is not None:
            low, high = self.output_len_range
            if not 1 <= low <= high:
                raise ValueError(f"--output-len-range a:b needs 1 <= a <= b, got {low}:{high}")
        if self.num_turns < 1:
            raise ValueError(f"--num-turns must be >= 1, got {self.num_turns}")
        if self.replica_cache_tokens is not None and self.replica_cache_tokens < 1:
            raise ValueError(f"--replica-cache-tokens must be >= 1, got {self.replica_cache_tokens}")

    @property
    def effective_num_prefixes(self) -> int:
        """K, after ``replica_cache_tokens`` raised it for ``cross-replica`` (twice what one replica can hold)."""
        if self.workload == "cross-replica" and self.replica_cache_tokens is not None and self.prefix_len > 0:
            return max(self.num_prefixes, 2 * math.ceil(self.replica_cache_tokens / self.prefix_len))
        return self.num_prefixes


@dataclass(frozen=True)
class Turn:
    """One request of a session: the new user piece and how many tokens to generate."""

    request_index: int
    user: Prompt
    output_len: int
    min_gap_s: float = 0.0
    """Send no sooner than this long after the session's previous turn was sent (multi-round-qa's pacing)."""


@dataclass(frozen=True)
class Session:
    """Requests sent one after the other (one turn except for multi-turn). ``group`` is the prefix id (-1: none)."""

    session_id: int
    group: int
    system: Prompt
    turns: tuple[Turn, ...] = field(default_factory=tuple)
    start_s: float | None = None
    """When to start, in seconds after the phase starts (a trace's timestamp); None: the load config decides."""


def seeded_rng(seed: int, *names: object) -> random.Random:
    """A generator seeded with ``"seed/name/..."`` (string seeds hash with sha512: stable across processes)."""
    return random.Random("/".join(str(part) for part in (seed, *names)))


def draw_output_len(config: WorkloadConfig, stream: str, request_index: int) -> int:
    """``output_len``, or a seeded uniform draw from ``output_len_range`` for request ``request_index``."""
    if config.output_len_range is None:
        return config.output_len
    low, high = config.output_len_range
    return seeded_rng(config.seed, stream, "output", request_index).randint(low, high)


def make_prefixes(config: WorkloadConfig, factory: PromptFactory) -> list[Prompt]:
    """The K shared prefixes (each from its own seeded stream)."""
    return [
        factory.make(config.prefix_len, seeded_rng(config.seed, "prefix", k))
        for k in range(config.effective_num_prefixes)
    ]


def assign_prefixes(config: WorkloadConfig, num_requests: int) -> list[int]:
    """Prefix id per request: seeded uniform choice (shared-prefix) or round-robin i mod K (cross-replica)."""
    num_prefixes = config.effective_num_prefixes
    if config.workload == "cross-replica":
        return [index % num_prefixes for index in range(num_requests)]
    rng = seeded_rng(config.seed, "assign")
    return [rng.randrange(num_prefixes) for _ in range(num_requests)]


def build_single_turn_sessions(config: WorkloadConfig, factory: PromptFactory) -> list[Session]:
    """Sessions of one request for shared-prefix, cross-replica and unique."""
    if config.workload == "unique":
        return build_unique_sessions(config, factory, "unique", config.num_requests)
    prefixes = make_prefixes(config, factory)
    sessions = []
    for index, group in enumerate(assign_prefixes(config, config.num_requests)):
        suffix = factory.make(config.suffix_len, seeded_rng(config.seed, "suffix", index))
        turn = Turn(index, suffix, draw_output_len(config, "main", index))
        sessions.append(Session(index, group, prefixes[group], (turn,)))
    return sessions


def build_unique_sessions(config: WorkloadConfig, factory: PromptFactory, stream: str, count: int) -> list[Session]:
    """``count`` one-request sessions of P + S fresh tokens each (also used for warm-up, with stream "warmup")."""
    sessions = []
    for index in range(count):
        rng = seeded_rng(config.seed, stream, index)
        system = factory.make(config.prefix_len, rng)
        turn = Turn(index, factory.make(config.suffix_len, rng), draw_output_len(config, stream, index))
        sessions.append(Session(index, -1, system, (turn,)))
    return sessions


def build_multi_turn_sessions(config: WorkloadConfig, factory: PromptFactory) -> list[Session]:
    """ceil(N / T) conversations of T turns (the last one shorter) on system prompts chosen round-robin from K."""
    prefixes = make_prefixes(config, factory)
    num_conversations = math.ceil(config.num_requests / config.num_turns)
    sessions = []
    request_index = 0
    for conversation in range(num_conversations):
        num_turns = min(config.num_turns, config.num_requests - request_index)
        turns = []
        for turn_index in range(num_turns):
            rng = seeded_rng(config.seed, "turn", conversation, turn_index)
            output_len = draw_output_len(config, "main", request_index)
            turns.append(Turn(request_index, factory.make(config.suffix_len, rng), output_len))
            request_index += 1
        group = conversation % len(prefixes)
        sessions.append(Session(conversation, group, prefixes[group], tuple(turns)))
    return sessions


def build_sessions(config: WorkloadConfig, factory: PromptFactory) -> list[Session]:
    """The measured sessions of ``config.workload`` (``config.num_requests`` requests in all, except for the standard
    workloads, whose parameters size them)."""
    if config.workload in STANDARD_WORKLOAD_NAMES:
        from bench.standard_workloads import build_standard_sessions

        return build_standard_sessions(config.workload, config.standard, factory, config.seed, config.num_requests)
    if config.workload == "multi-turn":
        return build_multi_turn_sessions(config, factory)
    return build_single_turn_sessions(config, factory)


def build_warmup_sessions(config: WorkloadConfig, factory: PromptFactory, count: int) -> list[Session]:
    """Warm-up requests: same shape as the workload, fresh tokens, so they warm the server but not its cache."""
    return build_unique_sessions(config, factory, "warmup", count)


def count_requests(sessions: Sequence[Session]) -> int:
    """Total number of requests (turns) in ``sessions``."""
    return sum(len(session.turns) for session in sessions)
