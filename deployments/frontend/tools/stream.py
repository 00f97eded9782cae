"""One chat request's output seen through its tools: what may be streamed as content now, and
the content and tool calls once it has finished.

A forced choice (`required`, named) holds all text back: it is JSON that becomes `tool_calls`.
`auto` streams content up to the family's call marker (or a text that may begin one) and holds
the rest until the end, when the parser decides. In `auto` the engine keeps special tokens in
the text (the markers are special tokens); every other special token is dropped here.

Calls stream too (`stream_calls`): a call's name as soon as it is known, then its arguments'
text as it decodes (deployments/frontend/tools/partial.py); `finish_stream` sends what is left, so a
call's streamed arguments concatenate to the arguments of the whole response.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from deployments.frontend.openai.tools import ToolPlan
from deployments.frontend.tools.parsers import ParsedCall
from deployments.frontend.tools.partial import partial_calls, scan_forced

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: `name` on its first piece only, then argument text."""

    index: int
    name: str | None
    arguments: str


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
        self._args_sent: list[str] = []  # per call whose name was sent: its arguments so far

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

    def stream_calls(self) -> list[CallDelta]:
        """The calls' new pieces since the last call (names once known, argument text)."""
        out = []
        for index, (name, arguments) in enumerate(self._calls_so_far()):
            out += self._advance(index, name, arguments)
        return out

    def finish_stream(
        self, finish_reason: str | None
    ) -> tuple[str, tuple[ParsedCall, ...], list[CallDelta]]:
        """`finish`, and the calls' last pieces; content is empty once calls were streamed."""
        rest, calls = self.finish(finish_reason)
        if not calls and self._args_sent:
            return "", calls, []  # a call cut short (length): its pieces were already sent
        tail = []
        for index, call in enumerate(calls):
            tail += self._advance(index, call.name, call.arguments, final=True)
        return rest, calls, tail

    def _calls_so_far(self) -> list[tuple[str, str]]:
        plan = self.plan
        if plan.forced:
            raw = scan_forced(self.text, plan.named if plan.mode == "named" else None)
            return [(c.name, c.arguments(self.text)) for c in raw if c.name is not None]
        if plan.mode == "auto" and plan.parser is not None:
            found = partial_calls(plan.parser, self.text, plan.schemas)
            return [(name, args) for name, args in found if name in plan.schemas]
        return []

    def _advance(
        self, index: int, name: str, arguments: str, final: bool = False
    ) -> list[CallDelta]:
        if index == len(self._args_sent):
            self._args_sent.append(arguments)
            return [CallDelta(index, name, arguments)]
        sent = self._args_sent[index]
        if not arguments.startswith(sent):
            if final:  # NOTE: tool_partial only streams prefixes; this would be its bug
                log.warning("streamed arguments of call %d are not a prefix of the final", index)
            return []
        self._args_sent[index] = arguments
        return (
            [CallDelta(index, None, arguments[len(sent) :])] if len(arguments) > len(sent) else []
        )

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
