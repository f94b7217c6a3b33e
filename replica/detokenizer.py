"""Incremental detokenization with stop strings.

Text is decoded from all output tokens each step and the new part emitted, except:
- a trailing U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until completed;
- the last ``len(longest stop string) - 1`` characters are held back while unfinished, since they may start a stop
  string; when a stop string appears, the text is cut before it and generation stops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizeResult:
    new_text: str
    stopped: bool


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.num_emitted_chars = 0
        self.text = ""

    def update(self, output_token_ids: list[int], finished: bool) -> DetokenizeResult:
        """Decode ``output_token_ids`` (all of them so far); returns the text not emitted before."""
        if self.tokenizer is None:
            return DetokenizeResult("", False)
        text = self.tokenizer.decode(output_token_ids, skip_special_tokens=True)
        stopped = False
        if self.stop:
            search_from = max(0, self.num_emitted_chars - self.holdback)
            cut = _first_stop(text, self.stop, search_from)
            if cut is not None:
                text, stopped, finished = text[:cut], True, True
        self.text = text
        end = len(text)
        if not finished:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            end = max(self.num_emitted_chars, end - self.holdback)
        new_text = text[self.num_emitted_chars : end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return DetokenizeResult(new_text, stopped)


def _first_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    positions = [pos for pos in (text.find(s, search_from) for s in stops) if pos >= 0]
    return min(positions) if positions else None
