"""Guided decoding (TensorRT-LLM's guided_decoding_backend "xgrammar"): a request's output follows a JSON schema,
any JSON, a regex or an EBNF grammar. Grammars compile in worker processes, each compile bounded in time and memory
(backend/guided/worker.py), once per grammar (the compiled ones are cached); each step the sampler's host half fills
one token bitmask row per guided sequence from its matcher, and the device half masks those rows
(backend/core/sampler.py)."""
from typing import Callable

from backend.core.request import RequestError

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


class GuidedDecoding:
    def __init__(self, tokenizer_dir: str, vocab_size: int, time_limit_s: float = 5.0,
                 memory_limit_bytes: int = 512 << 20):
        import xgrammar

        from backend.guided.worker import GrammarWorkers
        from backend.text import tokenizer_from_dir
        self.xgr = xgrammar
        tokenizer = tokenizer_from_dir(tokenizer_dir)
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.workers = GrammarWorkers(tokenizer_dir, vocab_size, self.info, time_limit_s, memory_limit_bytes)

    def compile(self, guide_type: str, guide: str, cancelled: Callable[[], bool] = lambda: False):
        """The compiled grammar of a request, or a RequestError naming what is wrong with it or the limit its compile
        passed."""
        if guide_type not in GUIDE_TYPES:
            raise RequestError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got "
                                                             f"{guide_type!r}")
        if guide_type != "json" and not guide:
            raise RequestError("guided_decoding_guide", f"is required for guide type {guide_type}")
        return self.workers.compile(guide_type, guide or "", cancelled)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)
