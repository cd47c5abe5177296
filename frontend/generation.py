"""A request's choices: each prompt one core request with n sequences, their tokens turned into text deltas.

Every core request ends when the consumer stops: the core's final answer, every choice stopped by a stop string,
or the client gone (the caller closes `deltas`, which closes each core stream and so cancels it in the core).
"""
import asyncio
import uuid
from collections.abc import AsyncIterator

import numpy as np

from frontend.adapters import Adapter
from frontend.choice import Choice, Delta
from frontend.core import CoreClient, ScoredPrompt


class Generation:
    def __init__(self, core: CoreClient, tokenizer, prompts: list[list[int]], arrays: list[dict[str, np.ndarray]],
                 adapter: Adapter | None, n: int, max_tokens: list[int], stop: list[str], end_ids: tuple[int, ...]):
        self.core = core
        self.prompts = prompts
        self.arrays = arrays
        self.adapter = adapter
        self.n = n
        self.id = uuid.uuid4().hex
        self.choices = [Choice(i, tokenizer, max_tokens[i // n], stop, frozenset(end_ids))
                        for i in range(len(prompts) * n)]
        self.scored: dict[int, ScoredPrompt] = {}            # prompt index -> its log probs, when asked for

    @property
    def usage(self) -> dict:
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come (each choice's in order), its last one with its finish_reason."""
        streams = [self._prompt(p) for p in range(len(self.prompts))]
        async for delta in merge(streams):
            yield delta

    async def _prompt(self, p: int) -> AsyncIterator[Delta]:
        choices = self.choices[p * self.n:(p + 1) * self.n]
        stream = self.core.generate(self.arrays[p], self.adapter, request_id=f"oai-{self.id}-{p}")
        try:
            async for chunk in stream:
                if chunk.prompt is not None:
                    self.scored[p] = chunk.prompt
                choice = choices[chunk.sequence_index]
                if choice.finished:
                    continue
                delta = choice.add(chunk.token_ids, chunk.log_probs, chunk.top_ids, chunk.top_log_probs)
                if delta.text or delta.token_ids:
                    yield delta
                if choice.stopped:
                    yield choice.finish()
                    if all(c.finished for c in choices):
                        return                     # closing the stream cancels the core request
            for choice in choices:
                if not choice.finished:
                    yield choice.finish()
        finally:
            await stream.aclose()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come, each one's in order; closing it closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    pending = {asyncio.ensure_future(anext(s)): s for s in streams}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                stream = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(stream))] = stream
                yield item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
