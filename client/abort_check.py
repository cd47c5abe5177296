"""Checks a tritonserver for the abort one gRPC client can cause in 2.51 (the release nvidia-pytriton bundles):
streamed requests to a decoupled model interleaved, on one gRPC stream, with requests to a model that does not
exist; the stream closed; a second stream the same way, a few ms apart. tritonserver 2.51 then often dies with
`proto_buffer_writer.h:65 ASSERTION FAILED: !byte_buffer->Valid()` (signal 6), every stream of every client with
it. A minimal decoupled Python model (one thread sending n responses) does the same, so the trigger lies in
tritonserver's gRPC stream handling, not in the model. Run it against your deployment (a newer NGC tritonserver
may have it fixed):

    python -m client.abort_check --url 127.0.0.1:8001 [--model lora_llm] [--rounds 5]
It reports whether the server answered every request of each round, and whether it survived (exit status 1 if not).
"""
import argparse
import queue
import sys
import time
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient

from client.grpc_client import build_inputs

MISSING_MODEL = "no_such_model"


@dataclass
class Round:
    sent: int = 0
    answered: int = 0                         # requests that got their final response, an error, or the stream's
    errors: list[str] = field(default_factory=list)
    stream_broke: bool = False                # the server closed the stream (it died, or refused it)


def one_stream(url: str, model: str, num_requests: int, gap_s: float, max_tokens: int, timeout_s: float) -> Round:
    """num_requests on one stream, every other one to a model that does not exist; then the stream is closed."""
    result = Round()
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i in range(num_requests):
            target = model if i % 2 == 0 else MISSING_MODEL
            client.async_stream_infer(target, build_inputs([5, 6, 7, 8], max_tokens, True, end_id=-1),
                                      enable_empty_final_response=True)
            result.sent += 1
            time.sleep(gap_s)
    except Exception as err:                  # the stream broke while we were sending
        result.stream_broke = True
        result.errors.append(str(err))
    deadline = time.monotonic() + timeout_s
    while result.answered < result.sent and time.monotonic() < deadline:
        try:
            response, error = responses.get(timeout=0.5)
        except queue.Empty:
            continue
        if error is not None:
            result.errors.append(str(error))
            if "StatusCode" in str(error):            # the stream itself ended: an error for each request on it
                result.stream_broke = True
                result.answered = result.sent
            else:
                result.answered += 1
        elif response.get_response().parameters["triton_final_response"].bool_param:
            result.answered += 1
    try:
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    return result


def is_live(url: str) -> bool:
    try:
        return grpcclient.InferenceServerClient(url).is_server_live()
    except Exception:
        return False


def check(url: str, model: str = "lora_llm", rounds: int = 5, max_tokens: int = 100,
          timeout_s: float = 120) -> list[tuple[Round, Round, bool]]:
    """Each round: a stream of 10 requests at once, one of 16 spaced 5 ms apart, then whether the server is live."""
    out = []
    for _ in range(rounds):
        first = one_stream(url, model, 10, 0.0, max_tokens, timeout_s)
        second = one_stream(url, model, 16, 0.005, max_tokens, timeout_s)
        time.sleep(1)
        out.append((first, second, is_live(url)))
        if not out[-1][2]:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m client.abort_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="lora_llm", help="a decoupled (streaming) model of the server")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for i, (first, second, live) in enumerate(check(args.url, args.model, args.rounds), start=1):
        for name, r in (("10 at once", first), ("16 spaced", second)):
            print(f"round {i}, {name}: {r.answered}/{r.sent} answered, {len(r.errors)} errors"
                  + (", stream broken" if r.stream_broke else ""))
        if not live:
            print(f"round {i}: the server is gone: it aborted (check its log for proto_buffer_writer.h)")
            sys.exit(1)
    print("the server survived every round")


if __name__ == "__main__":
    main()
