"""Grammar-constrained decoding: what a request asks for (`GrammarSpec`), the JSON-schema subset
we can enforce (`schema_check`), compiled grammars cached per schema (`compiler`), one matcher per
constrained request on the engine's side (`runtime`) and the token mask the sampler applies
(`token_mask`). Only `compiler` and `runtime` import xgrammar, and only when a grammar is used,
so the engine runs without it when no request asks for one."""

from __future__ import annotations

from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec

__all__ = ["GrammarError", "GrammarSpec"]
