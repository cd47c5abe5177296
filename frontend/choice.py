"""One choice of a response: its tokens as they arrive, their text, the stop strings that end it, and why it ended."""
from dataclasses import dataclass, field

from backend.text import IncrementalDetokenizer


@dataclass(slots=True)
class Delta:
    """What a choice adds in one chunk: text, and the tokens (with log probs) that arrived with it."""
    index: int
    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str | None = None
    top_ids: list[list[int]] = field(default_factory=list)          # by token, when top alternatives were asked for
    top_log_probs: list[list[float]] = field(default_factory=list)


@dataclass
class Choice:
    """Text is held back while its end could still begin a stop string (as vLLM does), so that a stop string is
    never streamed; a found stop string ends the choice there, itself left out."""
    index: int
    tokenizer: object
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    end_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_sent: int = 0                          # characters of text already streamed
    stopped: bool = False                      # by a stop string
    finished: bool = False

    def __post_init__(self):
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.hold = max(map(len, self.stop), default=1) - 1

    def add(self, token_ids: list[int], log_probs: list[float], top_ids: list[list[int]] = (),
            top_log_probs: list[list[float]] = ()) -> Delta:
        """The delta these tokens make (its text may be empty); tokens after a stop string or past max_tokens (0:
        the prompt is only scored) are dropped."""
        taken = 0
        for token in token_ids:
            if self.stopped or len(self.token_ids) >= self.max_tokens:
                break
            self.token_ids.append(token)
            taken += 1
            piece = self.detokenizer.add([token])
            if piece and self.stop:
                start = max(0, len(self.text) - self.hold)
                self.text += piece
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    self.stopped = True
            else:
                self.text += piece
        end = len(self.text) if self.stopped else max(self.num_sent, len(self.text) - self.hold)
        delta = self._delta(end, token_ids[:taken], log_probs[:taken])
        if len(top_ids) == len(token_ids):
            delta.top_ids, delta.top_log_probs = list(top_ids[:taken]), list(top_log_probs[:taken])
        return delta

    def finish(self) -> Delta:
        """The last delta: the text held back, and why the choice ended."""
        self.finished = True
        delta = self._delta(len(self.text), [], [])
        delta.finish_reason = self.finish_reason
        return delta

    @property
    def finish_reason(self) -> str:
        """"stop" for a stop string, the end token, or a complete guide; "length" at max_tokens."""
        if self.stopped or len(self.token_ids) < self.max_tokens:
            return "stop"
        return "stop" if self.token_ids and self.token_ids[-1] in self.end_ids else "length"

    def _delta(self, end: int, token_ids: list[int], log_probs: list[float]) -> Delta:
        text = self.text[self.num_sent:end]
        self.num_sent = end
        return Delta(self.index, text, token_ids, log_probs if len(log_probs) == len(token_ids) else [])
