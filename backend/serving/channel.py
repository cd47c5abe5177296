"""The connection between a model's stub and its engine process: whole messages (pickled tuples) over a Unix socket,
sent from any thread. Buffers of `SHARED_BYTES` or more (adapter uploads, logits) are not copied through the
socket: each goes into a memfd whose descriptor travels with the message, and the receiver maps it, so it costs one
copy and leaves no name behind when either side dies. Tensors travel as their bytes (numpy views, no torch
serialization)."""
import copyreg
import io
import mmap
import os
import pickle
import socket
import struct
import threading

import numpy as np
import torch

SHARED_BYTES = 1 << 20
MAX_BUFFERS = 64                              # out-of-band buffers in one message (descriptors per sendmsg)
HEADER = struct.Struct("<QI")                 # payload bytes, buffer count


class ChannelClosed(EOFError):
    """The other side is gone."""


def _tensor(data: np.ndarray, dtype: str, shape: tuple) -> torch.Tensor:
    return torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)


def _reduce_tensor(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    return _tensor, (t.view(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table | {torch.Tensor: _reduce_tensor}


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.closed = False

    def send(self, message) -> None:
        """Raises ChannelClosed where the other side is gone."""
        buffers: list[pickle.PickleBuffer] = []

        def out_of_band(buffer: pickle.PickleBuffer) -> bool:
            if buffer.raw().nbytes < SHARED_BYTES or len(buffers) == MAX_BUFFERS:
                return True                               # in the pickle
            buffers.append(buffer)
            return False

        data = io.BytesIO()
        _Pickler(data, protocol=5, buffer_callback=out_of_band).dump(message)
        payload = data.getbuffer()
        fds = [_memfd(b.raw()) for b in buffers]
        sizes = [b.raw().nbytes for b in buffers]
        head = HEADER.pack(len(payload), len(fds)) + struct.pack(f"<{len(fds)}Q", *sizes)
        try:
            with self.send_lock:
                if self.closed:
                    raise ChannelClosed("the channel is closed")
                socket.send_fds(self.sock, [head], fds) if fds else self.sock.sendall(head)
                self.sock.sendall(payload)
        except OSError as err:
            self.closed = True
            raise ChannelClosed(str(err)) from None
        finally:
            for fd in fds:
                os.close(fd)

    def recv(self):
        """The next message, from one thread at a time; raises ChannelClosed at the end."""
        try:
            head, fds, _, _ = socket.recv_fds(self.sock, HEADER.size, MAX_BUFFERS)
        except OSError as err:
            raise ChannelClosed(str(err)) from None
        try:
            if not head:
                raise ChannelClosed("the other side closed the channel")
            head += self._read(HEADER.size - len(head))
            num_bytes, num_buffers = HEADER.unpack(head)
            sizes = struct.unpack(f"<{num_buffers}Q", self._read(8 * num_buffers))
            if len(fds) != num_buffers:
                raise ChannelClosed(f"{len(fds)} descriptors arrived for {num_buffers} buffers")
            buffers = [_mapped(fd, size) for fd, size in zip(fds, sizes)]
            return pickle.loads(self._read(num_bytes), buffers=buffers)
        finally:
            for fd in fds:
                os.close(fd)

    def _read(self, num_bytes: int) -> bytes:
        chunks, left = [], num_bytes
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 22))
            except OSError as err:
                raise ChannelClosed(str(err)) from None
            if not chunk:
                raise ChannelClosed("the other side closed the channel mid-message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _memfd(view: memoryview) -> int:
    fd = os.memfd_create("lora-llm-buffer", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, view.nbytes)
        with mmap.mmap(fd, view.nbytes) as region:
            region[:] = view.cast("B")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _mapped(fd: int, size: int) -> memoryview | bytes:
    if size == 0:
        return b""
    return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE))
