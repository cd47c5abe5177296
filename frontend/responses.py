"""OpenAI response objects: whole completions and their streamed chunks, for the legacy and the chat API."""
import json
import time

from frontend.choice import Delta


class Responses:
    """Builds one request's response objects; `chat` picks the chat API's shapes."""

    def __init__(self, generation_id: str, model: str, tokenizer, chat: bool, log_probs: bool):
        self.id = ("chatcmpl-" if chat else "cmpl-") + generation_id
        self.model = model
        self.tokenizer = tokenizer
        self.chat = chat
        self.log_probs = log_probs
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}            # completions' logprobs: each choice's characters so far

    def _object(self, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def chunk(self, delta: Delta, first: bool = False) -> str:
        """One streamed chunk as a server-sent event."""
        if self.chat:
            message = ({"role": "assistant", "content": ""} if first else {}) | (
                {"content": delta.text} if delta.text else {})
            choice = {"index": delta.index, "delta": message, "logprobs": self.logprobs(delta),
                      "finish_reason": delta.finish_reason}
            return event(self._object("chat.completion.chunk", [choice]))
        choice = {"index": delta.index, "text": delta.text, "logprobs": self.logprobs(delta),
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
            joined = Delta(index, text, [t for d in parts for t in d.token_ids], [lp for d in parts for lp in d.log_probs])
            reason = parts[-1].finish_reason if parts else None
            self.text_offsets[index] = len(prefixes[index]) if prefixes else 0
            logprobs = self.logprobs(joined)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage)

    def logprobs(self, delta: Delta) -> dict | None:
        """The chosen tokens' log probs (no top alternatives): chat's `content` list, or the legacy arrays."""
        if not self.log_probs or not delta.token_ids:
            return None
        tokens = [self.tokenizer.decode([t]) for t in delta.token_ids]
        if self.chat:
            return {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
                                for token, lp in zip(tokens, delta.log_probs)]}
        offsets, offset = [], self.text_offsets.get(delta.index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[delta.index] = offset
        return {"tokens": tokens, "token_logprobs": delta.log_probs, "top_logprobs": None, "text_offset": offsets}


def event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


DONE = event("[DONE]")
