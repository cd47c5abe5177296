"""OpenAI response objects: whole completions and their streamed chunks, for the legacy and the chat API, with log
probs in OpenAI's shapes (and vLLM's prompt_logprobs)."""
import json
import math
import time
from dataclasses import dataclass

from frontend.choice import Delta

PROMPT_ENTRY_BYTES = 80                   # a prompt_logprobs entry's JSON ('"id":{"logprob","rank","decoded_token"}')
TOKEN_ENTRY_BYTES = 60                    # a chosen token's or an alternative's, in logprobs
MAX_RESPONSE_BYTES = 64 << 20             # a response's log probs past this are refused before any work


@dataclass(frozen=True)
class LogProbsAsked:
    """What a request asked for: the chosen tokens' log probs, k alternatives at each (completions' logprobs,
    chat's top_logprobs), the prompt's own in the output (completions' echo), vLLM's prompt_logprobs (its k)."""
    chosen: bool = False
    num_top: int = 0
    echo: bool = False
    prompt_top: int | None = None

    @property
    def scores_prompt(self) -> bool:
        return (self.echo and self.chosen) or self.prompt_top is not None


class Responses:
    """Builds one request's response objects; `chat` picks the chat API's shapes."""

    def __init__(self, generation, model: str, tokenizer, chat: bool, asked: LogProbsAsked):
        self.id = ("chatcmpl-" if chat else "cmpl-") + generation.id
        self.generation = generation                      # its prompts, n, and scored prompts (as they arrive)
        self.model = model
        self.tokenizer = tokenizer
        self.chat = chat
        self.asked = asked
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}            # completions' logprobs: each choice's characters so far

    def _object(self, kind: str, choices: list[dict], usage: dict | None = None, **extra) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out | extra

    def chunk(self, delta: Delta, first: bool = False, echo: bool = False) -> str:
        """One streamed chunk as a server-sent event (echo: the choice's first, after its prompt's text)."""
        if self.chat:
            message = ({"role": "assistant", "content": ""} if first else {}) | (
                {"content": delta.text} if delta.text else {})
            choice = {"index": delta.index, "delta": message, "logprobs": self.logprobs(delta),
                      "finish_reason": delta.finish_reason}
            return event(self._object("chat.completion.chunk", [choice]))
        choice = {"index": delta.index, "text": delta.text, "logprobs": self.logprobs(delta, echo),
                  "finish_reason": delta.finish_reason}
        return event(self._object("text_completion", [choice]))

    def role_chunk(self, index: int) -> str:
        """The chat stream's first chunk of a choice: its role."""
        return self.chunk(Delta(index, "", [], []), first=True)

    def usage_chunk(self, usage: dict) -> str:
        return event(self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage))

    def whole(self, deltas: list[list[Delta]], usage: dict, prefixes: list[str] | None = None) -> dict:
        """The non-streamed response: each choice's deltas joined (prefixes: echoed prompts, per choice)."""
        choices = []
        for index, parts in enumerate(deltas):
            text = (prefixes[index] if prefixes else "") + "".join(d.text for d in parts)
            joined = Delta(index, text, [t for d in parts for t in d.token_ids],
                           [lp for d in parts for lp in d.log_probs], None,
                           [top for d in parts for top in d.top_ids], [top for d in parts for top in d.top_log_probs])
            reason = parts[-1].finish_reason if parts else None
            self.text_offsets[index] = len(prefixes[index]) if prefixes else 0
            logprobs = self.logprobs(joined, echo=bool(prefixes))
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
                               | (self._prompt_logprobs(index) if index % self.generation.n == 0 else
                                  {"prompt_logprobs": None} if self.asked.prompt_top is not None else {}))
        extra = self._prompt_logprobs(0) if self.chat else {}      # vLLM's chat: one list for the request
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage, **extra)

    def logprobs(self, delta: Delta, echo: bool = False) -> dict | None:
        """The chosen tokens' log probs and their top alternatives: chat's `content` list, or the legacy arrays
        (echo: the prompt's first, the first of them None)."""
        if not self.asked.chosen:
            return None
        if self.chat:
            if not delta.token_ids:
                return None
            return {"content": [self._chat_entry(t, lp, delta.top_ids[i] if delta.top_ids else [],
                                                 delta.top_log_probs[i] if delta.top_log_probs else [])
                                for i, (t, lp) in enumerate(zip(delta.token_ids, delta.log_probs))]}
        ids, log_probs, tops = list(delta.token_ids), list(delta.log_probs), self._tops(delta)
        if echo:
            p = delta.index // self.generation.n
            scored, prompt = self.generation.scored.get(p), self.generation.prompts[p]
            if scored is not None:
                ids, log_probs = prompt + ids, [_none_if_nan(x) for x in scored.log_probs] + log_probs
                tops = None if tops is None else [None] + [self._top_dict(*row) for row in zip(
                    prompt[1:], scored.log_probs[1:], scored.top_ids[1:], scored.top_log_probs[1:])] + tops
                self.text_offsets[delta.index] = 0
        if not ids:
            return None
        tokens = [self.tokenizer.decode([t]) for t in ids]
        offsets, offset = [], self.text_offsets.get(delta.index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[delta.index] = offset
        return {"tokens": tokens, "token_logprobs": log_probs, "top_logprobs": tops, "text_offset": offsets}

    def _tops(self, delta: Delta) -> list[dict] | None:
        """Completions' top_logprobs: by token, its alternatives' text -> log prob, the chosen one among them."""
        if not self.asked.num_top or len(delta.top_ids) != len(delta.token_ids):
            return None
        return [self._top_dict(*row) for row in zip(delta.token_ids, delta.log_probs, delta.top_ids,
                                                     delta.top_log_probs)]

    def _top_dict(self, token: int, log_prob: float, top_ids: list[int], top_log_probs: list[float]) -> dict:
        k = self.asked.num_top
        out = {self.tokenizer.decode([t]): lp for t, lp in zip(top_ids[:k], top_log_probs[:k])}
        out.setdefault(self.tokenizer.decode([token]), log_prob)
        return out

    def _chat_entry(self, token: int, log_prob: float, top_ids: list[int], top_log_probs: list[float]) -> dict:
        text = self.tokenizer.decode([token])
        top = [{"token": (alt := self.tokenizer.decode([t])), "logprob": lp, "bytes": list(alt.encode())}
               for t, lp in zip(top_ids[:self.asked.num_top], top_log_probs[:self.asked.num_top])]
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode()), "top_logprobs": top}

    def _prompt_logprobs(self, index: int) -> dict:
        """vLLM's prompt_logprobs of a choice's prompt: None, then by position {token id: {logprob, rank,
        decoded_token}} for the prompt token and the k most likely."""
        k = self.asked.prompt_top
        if k is None:
            return {}
        p = index // self.generation.n
        scored, prompt = self.generation.scored.get(p), self.generation.prompts[p]
        if scored is None:
            return {"prompt_logprobs": None}
        out = [None]
        for i in range(1, len(prompt)):
            entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self.tokenizer.decode([t])}
                     for rank, (t, lp) in enumerate(zip(scored.top_ids[i][:k], scored.top_log_probs[i][:k]), 1)}
            entry.setdefault(str(prompt[i]), {"logprob": scored.log_probs[i], "rank": scored.ranks[i],
                                              "decoded_token": self.tokenizer.decode([prompt[i]])})
            out.append(entry)
        return {"prompt_logprobs": out}


def estimated_bytes(asked: LogProbsAsked, prompts: list[list[int]], n: int, budgets: list[int], chat: bool) -> dict:
    """What a response's log probs will take at most, by the field that asks for them (its JSON, ~per entry):
    prompt_logprobs once per prompt, the chosen tokens' and their alternatives per choice (with echo, the prompt's
    too)."""
    out = {}
    if asked.prompt_top is not None:
        out["prompt_logprobs"] = sum(len(p) for p in prompts) * (asked.prompt_top + 1) * PROMPT_ENTRY_BYTES
    if asked.chosen:
        tokens = sum(budget + (len(p) if asked.echo and not chat else 0) for p, budget in zip(prompts, budgets))
        out["logprobs"] = n * tokens * (asked.num_top + 1) * TOKEN_ENTRY_BYTES
    return out


def json_pieces(payload: dict, piece_bytes: int = 1 << 16):
    """A response's JSON in pieces of about piece_bytes, encoded as they are taken (Python's incremental encoder: a
    thread serializing a large answer gives the interpreter back between pieces, where the C encoder would hold it
    for the whole answer)."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    buffer, size = [], 0
    for chunk in encoder.iterencode(payload):
        buffer.append(chunk)
        size += len(chunk)
        if size >= piece_bytes:
            yield "".join(buffer).encode()
            buffer, size = [], 0
    if buffer:
        yield "".join(buffer).encode()


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


DONE = event("[DONE]")
