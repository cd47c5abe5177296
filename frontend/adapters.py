"""Adapters by name: the store (a directory of adapter folders), each name's task id, and when weights must travel.

A folder holding a PEFT (adapter_config.json) or TensorRT-LLM (model.lora_*.npy) adapter is served under its folder
name. Its task id, the core's cache key, is the same on every replica and after every restart:
- a folder named by a number uses that number (the core's `lora_prefetch_dir` layout, so one directory can serve
  as both the prefetch dir and the store);
- `manifest.json` may name folders with fixed task ids: {"uppercase": {"path": "1", "task_id": 1}};
- any other folder gets 63 bits of a hash of its name and its files' bytes (new weights under an old name get a
  new id, so the core never holds two adapters under one id).
The core keeps the weights (host and device tiers); the frontend sends them with an adapter's first request, and
again only when the core answers that it no longer has them.
"""
import asyncio
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from frontend.errors import OpenAIError
from frontend.tensors import AdapterInputs, AdapterInvalid, AdapterLimits, AdapterTensors

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
ADAPTER_FILES = ("adapter_config.json", "model.lora_weights.npy")
MAX_TASK_ID = (1 << 63) - 1
MAX_PATH_CHARS = 4096                                  # Linux's PATH_MAX


def is_adapter_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ADAPTER_FILES)


def derived_task_id(name: str, content: bytes) -> int:
    """63 bits of a hash of the adapter's name and its content digest (backend/lora/files.py)."""
    digest = hashlib.blake2b(name.encode() + b"\0" + content, digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_TASK_ID


def content_digest(path: Path) -> bytes:
    """The digest of the adapter files in `path`, read as the server reads them (regular files, no links)."""
    from backend.lora.files import AdapterFileError, read_adapter_files
    try:
        return read_adapter_files(path).digest
    except AdapterFileError as err:
        raise ValueError(f"adapter folder {path.name!r}: {err}") from None


@dataclass(eq=False)
class Adapter:
    """One named adapter and whether the core has accepted its weights (as far as this frontend knows)."""
    name: str
    path: Path
    task_id: int
    accepted: bool = False
    upload: asyncio.Future | None = field(default=None, repr=False)     # set while a request carries the weights
    cache: AdapterTensors = field(default_factory=AdapterTensors, repr=False)
    in_store: bool = False                            # one of the store's: never unloaded
    digest: bytes | None = None                       # its files' content when first read: served only as that

    async def begin(self) -> asyncio.Future | None:
        """Before a request: an upload ticket when it must carry the weights, else None. While another request's
        upload is being written this waits for it, so that one adapter is uploaded once however many requests for it
        arrive at once."""
        while self.upload is not None:
            await asyncio.shield(self.upload)
        if self.accepted:
            return None
        self.upload = asyncio.get_running_loop().create_future()
        return self.upload

    def end(self, upload: asyncio.Future, accepted: bool) -> None:
        """The carrying request is written (accepted, until the core says otherwise) or failed before (not);
        once per ticket."""
        if upload.done():
            return
        self.accepted = accepted
        self.upload = None
        upload.set_result(None)

    def forget(self) -> None:
        """The core answered "not found" (its caches evicted the adapter, or it restarted) or refused the weights."""
        self.accepted = False

    async def inputs(self) -> AdapterInputs:
        """lora_weights and lora_config as a request carries them; refused once the folder's files no longer hold
        what was first read under this name (its task id names that content)."""
        inputs = await self.cache.get(self.path)
        self.digest = self.digest or inputs.digest
        if inputs.digest != self.digest:
            raise AdapterInvalid("its files changed since it was loaded: load it again under a name of its own")
        return inputs


class AdapterStore:
    """Names -> adapters: the store's folders at start, plus those loaded and unloaded at run time (when the
    operator allows it) from folders under the store or the allowed roots."""

    def __init__(self, root: Path | None, base_name: str, separator: str = "_lora_", cache_bytes: int = 1 << 30,
                 limits: AdapterLimits | None = None, roots: tuple[str, ...] = ()):
        self.base_name = base_name
        self.separator = separator
        self.cache = AdapterTensors(cache_bytes, limits)
        self.adapters: dict[str, Adapter] = {}
        self.loading: set[str] = set()                      # names whose load is under way: one at a time
        self.roots = [Path(os.path.realpath(r)) for r in ([root] if root is not None else []) + list(roots)]
        self.skipped: list[str] = []                        # store folders that could not even be read at start
        if root is not None:
            for name, (path, task_id) in scan(Path(root), self.skipped).items():
                self.adapters[name] = Adapter(name, path, task_id, cache=self.cache, in_store=True)

    def prepare(self) -> list[str]:
        """Read the store's adapters into the tensor cache while they fit (at start, off the event loop); those
        that cannot be served are dropped. -> a line for each dropped."""
        broken = dict(self.cache.prepare([adapter.path for adapter in self.adapters.values()]))
        dropped = {name: broken[a.path] for name, a in self.adapters.items() if a.path in broken}
        for name in dropped:
            del self.adapters[name]
        return self.skipped + [f"adapter {name!r} is not served: {why}" for name, why in dropped.items()]

    def resolve(self, model: str) -> Adapter | None:
        """The adapter a request's `model` names: `<adapter>` or `<base><separator><adapter>`; None for the base."""
        if model == self.base_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        prefix = self.base_name + self.separator
        if self.separator and model.startswith(prefix) and model[len(prefix):] in self.adapters:
            return self.adapters[model[len(prefix):]]
        raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    async def load(self, name: str, path: str) -> Adapter:
        """Serve the adapter in `path` under `name` (vLLM's /v1/load_lora_adapter), checked whole, off the event
        loop, before it is registered; a second load of a name under way is refused."""
        if not NAME_RE.fullmatch(name or "") or name == self.base_name:
            raise OpenAIError(400, f"lora_name {name!r} must be 1-128 letters, digits, '.', '_' or '-' and not the "
                                   "base model's name", param="lora_name")
        prefix = self.base_name + self.separator
        if self.separator and name.startswith(prefix):
            raise OpenAIError(400, f"lora_name {name!r} begins with {prefix!r}, the form that names an adapter "
                                   f"through the base model (`{prefix}<adapter>`): it could shadow one",
                              param="lora_name")
        if name in self.adapters or name in self.loading:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded"
                                   f"{'' if name in self.adapters else ' (its load is under way)'}.",
                              param="lora_name")
        self.loading.add(name)
        try:
            folder = self.allowed(path)
            try:
                inputs = await self.cache.get(folder)
            except AdapterInvalid as err:
                raise OpenAIError(400, f"lora_path {path!r} is not a valid adapter for this model: {err}",
                                  param="lora_path") from None
            adapter = Adapter(name, folder, derived_task_id(name, inputs.digest), cache=self.cache,
                              digest=inputs.digest)
            self.adapters[name] = adapter
            return adapter
        finally:
            self.loading.discard(name)

    def allowed(self, path: str) -> Path:
        """The real folder `path` names, when it and everything in it lie under one of the roots (a relative path is
        taken from the store); anything else is refused without saying what exists outside."""
        if not self.roots:
            raise OpenAIError(400, "lora_path: no adapter roots are configured (--adapter-store, --lora-roots)",
                              param="lora_path")
        if "\0" in (path or "") or len(path or "") > MAX_PATH_CHARS:
            raise OpenAIError(400, f"lora_path must hold at most {MAX_PATH_CHARS} characters and no NUL",
                              param="lora_path")
        outside = OpenAIError(400, f"lora_path {path!r} is not an adapter folder under the adapter store or the "
                                   "allowed roots", param="lora_path")
        try:
            folder = Path(os.path.realpath(self.roots[0] / (path or "")))
            root = next((r for r in self.roots if folder.is_relative_to(r)), None)
            if root is None or not is_adapter_dir(folder):
                raise outside
            for entry in folder.rglob("*"):                # a link inside that leads out
                if not Path(os.path.realpath(entry)).is_relative_to(root):
                    raise outside
        except (OSError, ValueError):                      # a name too long for the file system, and the like
            raise outside from None
        return folder

    def unload(self, name: str) -> None:
        """Stop serving `name`; the core's caches let the weights go by their own LRU. The store's own adapters
        stay."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        if adapter.in_store:
            raise OpenAIError(400, f"The lora adapter '{name}' is served from the adapter store and cannot be "
                                   "unloaded.", param="lora_name")
        del self.adapters[name]
        self.cache.drop(adapter.path)


def scan(root: Path, skipped: list[str] | None = None) -> dict[str, tuple[Path, int]]:
    """The store's adapters: name -> (folder, task id); a folder whose files cannot be read is left out, and why is
    added to `skipped`."""
    if not root.is_dir():
        raise FileNotFoundError(f"adapter store {root} is not a directory")
    found: dict[str, tuple[Path, int]] = {}
    manifest = root / "manifest.json"
    named = set()
    if manifest.is_file():
        for name, entry in json.loads(manifest.read_text()).items():
            folder = (root / entry["path"]).resolve()
            if not NAME_RE.fullmatch(name) or not is_adapter_dir(folder):
                raise ValueError(f"{manifest}: {name!r} must be a valid name and {entry['path']!r} an adapter folder")
            task_id = int(entry["task_id"])
            if not 0 <= task_id <= MAX_TASK_ID:
                raise ValueError(f"{manifest}: task_id {task_id} of {name!r} is outside [0, 2^63)")
            found[name] = (folder, task_id)
            named.add(folder)
    for folder in sorted(p for p in root.iterdir() if is_adapter_dir(p) and p.resolve() not in named):
        if NAME_RE.fullmatch(folder.name) and folder.name not in found:
            try:
                task_id = int(folder.name) if folder.name.isdigit() else derived_task_id(folder.name,
                                                                                        content_digest(folder))
            except ValueError as err:
                if skipped is not None:
                    skipped.append(f"adapter {folder.name!r} is not served: {err}")
                continue
            found[folder.name] = (folder.resolve(), task_id)
    ids = [task_id for _, task_id in found.values()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"adapter store {root}: two adapters share a task id")
    return found
