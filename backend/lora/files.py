"""An adapter folder's files read safely and whole: regular files only (a FIFO or a device would block or never end),
never through a symbolic link, each read from the descriptor that was checked, so that a file swapped in after the
check is not the one read. The bytes come with their digest, which names the adapter's content."""
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "model.lora_weights.npy", "model.lora_config.npy")


class AdapterFileError(ValueError):
    """A file of an adapter folder that cannot be read as one, and why (names the file, not the folder's path)."""


@dataclass(frozen=True)
class AdapterFiles:
    files: dict[str, bytes]                   # file name -> its bytes, for the adapter files present
    digest: bytes                             # of the names and bytes, in name order


def read_adapter_files(folder: str | Path, max_bytes: int | None = None) -> AdapterFiles:
    """The adapter files present in `folder` (itself not a link), each a regular file, together at most
    max_bytes."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(folder, flags | os.O_DIRECTORY)
    except OSError as err:
        raise AdapterFileError(f"the adapter folder cannot be opened ({err.strerror}; links are not followed)") \
            from None
    try:
        files, total = {}, 0
        for name in ADAPTER_FILES:
            try:
                fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise AdapterFileError(f"{name}: cannot be opened ({err.strerror}; links are not followed)") from None
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise AdapterFileError(f"{name}: is not a regular file")
                total += info.st_size
                if max_bytes is not None and total > max_bytes:
                    raise AdapterFileError(f"its files hold more than {max_bytes} bytes, more than an adapter of "
                                           "max_lora_rank on this model can")
                files[name] = read_exactly(f, info.st_size, name)
    finally:
        os.close(dir_fd)
    return AdapterFiles(files, digest_of(files))


def read_exactly(f, size: int, name: str) -> bytes:
    data = f.read(size + 1)                   # one byte more: a file that grew since its fstat is refused
    if len(data) != size:
        raise AdapterFileError(f"{name}: changed while it was read")
    return data


def digest_of(files: dict[str, bytes]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little") + files[name])
    return h.digest()
