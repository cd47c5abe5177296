"""scripts/server_process.py's probes: any failure to get a 200 is a no, never an exception that ends the supervisor
(a malformed status line from a server still starting used to), and a stale heartbeat is an engine that cannot
serve."""
import socket
import sys
import threading
import time

import pytest

from tests.helpers import ROOT

sys.path.append(str(ROOT / "scripts"))
from server_process import engine_alive, is_ready  # noqa: E402


def serve_once(answer: bytes) -> int:
    """A port that answers one connection with `answer` and closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def reply():
        connection, _ = listener.accept()
        connection.recv(4096)
        connection.sendall(answer)
        connection.close()
        listener.close()
    threading.Thread(target=reply, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize("answer", [b"garbage\r\n\r\n", b"HTTP/1.1 2OO OK\r\n\r\n", b""])
def test_a_malformed_answer_is_not_ready_and_raises_nothing(answer):
    assert is_ready(serve_once(answer)) is False


def test_a_stale_heartbeat_is_an_engine_that_cannot_serve():
    page = "lora_llm_engine_alive{model=\"lora_llm\",version=\"1\"} 1\n" \
           "lora_llm_engine_heartbeat_seconds{model=\"lora_llm\",version=\"1\"} %f\n"
    fresh = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (
        len(page % time.time()), (page % time.time()).encode()))
    assert engine_alive(fresh)
    body = (page % (time.time() - 60)).encode()
    stale = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert not engine_alive(stale)


def test_a_metrics_page_that_does_not_answer_is_a_hung_server():
    """tritonserver 2.51 hung in its own fatal-signal handler accepts connections and answers nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        assert engine_alive(listener.getsockname()[1], timeout_s=0.5) is False
    finally:
        listener.close()
