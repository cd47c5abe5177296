"""Incremental detokenization: text pieces as tokens arrive, never splitting a multi-byte character."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.emitted = ""

    def add(self, token_ids: list[int]) -> str:
        """The new text these tokens complete (empty while a character is still partial)."""
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""                              # wait for the rest of a multi-byte character
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        piece, self.emitted = text[len(self.emitted):], text
        return piece
