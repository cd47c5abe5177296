"""The responder's coalescing: several queued steps' outputs go out as one answer a stream where that keeps every
answer's meaning (one sequence, no generation logits, no beams), in order, the final flag on the last."""
import torch

from backend.core.outputs import StepOutput
from backend.serving.responder import coalesced


def out(request_id: str, tokens: list[int], sequence_index: int = 0, **fields) -> StepOutput:
    return StepOutput(request_id, tokens, log_probs=[-0.5] * len(tokens), sequence_index=sequence_index, **fields)


def test_a_streams_steps_merge_into_one_answer_with_all_their_tokens():
    a, b = object(), object()
    first = out("a", [1], prompt_log_probs=None, context_logits=torch.zeros(2, 4))
    emits = [(a, first, 0, False), (b, out("b", [7]), 0, False), (a, out("a", [2]), 0, False),
             (a, out("a", [3], finished=True, request_finished=True, finish_reason="length"), 0, True)]
    by_stream = {stream: (o, last) for stream, o, _, last in coalesced(emits)}
    merged, last = by_stream[a]
    assert merged.new_token_ids == [1, 2, 3] and merged.log_probs == [-0.5] * 3 and last
    assert merged.finished and merged.finish_reason == "length" and merged.context_logits is first.context_logits
    assert by_stream[b][0].new_token_ids == [7] and not by_stream[b][1]


def test_several_sequences_generation_logits_or_beams_keep_their_answers_apart():
    a, b, c = object(), object(), object()
    emits = [(a, out("a", [1], 0), 0, False), (a, out("a", [5], 1), 0, False), (a, out("a", [2], 0), 0, True),
             (b, out("b", [7], generation_logits=torch.zeros(4)), 0, False),
             (b, out("b", [8], generation_logits=torch.zeros(4)), 0, True),
             (c, out("c", [], beams=["round 1"]), 0, False), (c, out("c", [], beams=["round 2"]), 0, True)]
    assert coalesced(emits) == emits                                         # as they were, in order


def test_a_stop_queued_behind_steps_is_kept_and_ends_the_thread():
    """The responder gathers the steps queued behind the one it sends; a stop found among them still ends it."""
    import threading

    from backend.serving.responder import Responder
    release, got = threading.Event(), []

    class Stream:
        def emit(self, output, batch_index, last):
            release.wait(5)
            got.extend(output.new_token_ids)
    stream = Stream()
    responder = Responder(on_broken=lambda s: None)
    responder.emit([(stream, out("a", [1]), 0, False)])
    responder.emit([(stream, out("a", [2]), 0, False)])
    responder.emit([(stream, out("a", [3]), 0, True)])
    responder.calls.put(None)                                 # stop, behind the steps
    release.set()
    responder.thread.join(5)
    assert not responder.thread.is_alive() and got == [1, 2, 3] and responder.steps_queued == 0
