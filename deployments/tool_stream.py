"""One chat request's output seen through its tools: what may be streamed as content now, and
the content and tool calls once it has finished.

A forced choice (`required`, named) holds all text back: it is JSON that becomes `tool_calls`.
`auto` streams content up to the family's call marker (or a text that may begin one) and holds
the rest until the end, when the parser decides. In `auto` the engine keeps special tokens in
the text (the markers are special tokens); every other special token is dropped here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from deployments.openai_tools import ToolPlan
from deployments.tool_parsers import ParsedCall


def special_pattern(specials: Iterable[str], keep: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching the special tokens to drop from content (all but `keep`)."""
    drop = sorted(set(specials) - set(keep), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, drop))) if drop else None


class ToolOutput:
    def __init__(self, plan: ToolPlan, drop: re.Pattern[str] | None) -> None:
        self.plan, self._drop = plan, drop
        self._marker = plan.parser.start if plan.parser is not None else ""
        self.text = ""
        self._sent = 0

    def push(self, delta: str) -> str:
        """Add newly decoded text; returns the part that can be streamed as content now."""
        self.text += self._drop.sub("", delta) if self._drop is not None and delta else delta
        if self.plan.forced:
            return ""
        end = self._safe_end() if self.plan.mode == "auto" else len(self.text)
        out = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, tuple[ParsedCall, ...]]:
        """(content not streamed yet, tool calls) once the output is complete."""
        parsed = self.plan.calls(self.text, finish_reason)
        if parsed is None:
            return self.text[self._sent :], ()
        sent = self.text[: self._sent]
        rest = parsed.content[len(sent) :] if parsed.content.startswith(sent) else ""
        return rest, parsed.calls

    def _safe_end(self) -> int:
        """Where streamable content ends: at the call marker, or before a tail that may grow
        into one."""
        if not self._marker:
            return len(self.text)
        at = self.text.find(self._marker)
        if at >= 0:
            return at
        for k in range(min(len(self._marker) - 1, len(self.text)), 0, -1):
            if self._marker.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)
