"""Guided decoding (TensorRT-LLM's guided_decoding_backend "xgrammar"): a request's output follows a JSON schema,
any JSON, a regex or an EBNF grammar. Grammars compile once (cached by xgrammar, within GRAMMAR_CACHE_BYTES) off the
engine loop; each step the sampler's host half fills one token bitmask row per guided sequence from its matcher, and
the device half masks those rows (backend/sampler.py)."""
from backend.request import RequestError

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
GRAMMAR_CACHE_BYTES = 256 << 20               # compiled grammars kept for reuse; the least recently used go first


class GuidedDecoding:
    def __init__(self, tokenizer_dir: str, vocab_size: int):
        import xgrammar
        from backend.text import tokenizer_from_dir
        self.xgr = xgrammar
        tokenizer = tokenizer_from_dir(tokenizer_dir)
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compile(self, guide_type: str, guide: str):
        """The compiled grammar of a request, or a RequestError naming what is wrong with it."""
        if guide_type not in GUIDE_TYPES:
            raise RequestError("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got "
                                                             f"{guide_type!r}")
        if guide_type != "json" and not guide:
            raise RequestError("guided_decoding_guide", f"is required for guide type {guide_type}")
        try:
            if guide_type == "json":
                return self.compiler.compile_builtin_json_grammar()
            if guide_type == "json_schema":
                return self.compiler.compile_json_schema(guide)
            if guide_type == "regex":
                return self.compiler.compile_regex(guide)
            return self.compiler.compile_grammar(guide)
        except Exception as err:
            raise RequestError("guided_decoding_guide", f"does not compile as {guide_type}: "
                                                        f"{str(err).splitlines()[-1][:300]}") from None

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)
