"""One generated token into its request's output: the grammar's advance, the logprobs, the
detokenized text and the stop strings, in the order a step of one token would give them."""

from __future__ import annotations

from shortconv.engine.outputs import RequestOutput
from shortconv.engine.request import Request
from shortconv.engine.tokenizer import IncrementalDetokenizer
from shortconv.sampling.grammar.runtime import GrammarRuntime


def take_token(
    grammars: GrammarRuntime,
    detok: IncrementalDetokenizer | None,
    req: Request,
    out: RequestOutput,
    i: int,
    done: bool,
) -> bool:
    """Output token i of req into `out`; True when it ends the request here (a complete
    grammar, a stop string; the caller tells the scheduler). `done`: the scheduler ended it at
    this token. `detok`: the request's detokenizer (None: token ids only)."""
    tok = req.output_token_ids[i]
    grammar_done = grammars.accept(req.request_id, tok, done) and not done
    ended = done or grammar_done
    stop = grammar_done
    out.new_token_ids.append(tok)
    out.token_ids.append(tok)
    if out.logprobs is not None:
        out.logprobs.append(req.output_logprobs[i])
    if out.top_logprobs is not None:
        out.top_logprobs.append(req.output_top_logprobs[i])
    if detok is not None:
        text = detok.push([tok])
        if detok.stopped and not ended:
            stop = True
        elif ended:
            text += detok.flush()
        out.new_text += text
        out.text += text
    return stop
