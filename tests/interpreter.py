"""Triton's interpreter (TRITON_INTERPRET=1, Triton 3.x) patches triton.language again at every call of a
@triton.jit helper from inside a kernel: inspect.getmembers over the language modules, about 1.6 ms a call, up to
a third of a test's time (the decode expand calls its epilogue once a row). Inside a launch, a helper whose module
sees the same language modules as one already patched in it (triton.language, or triton.language.core for Triton's
own helpers such as tl.zeros) runs as it is; the first of each kind is patched as Triton does, and the launch's own
patching and restoring are Triton's, untouched."""
import triton.language as tl
from triton.runtime import interpreter


def languages(fn) -> frozenset[int]:
    """The language modules a jit function's module sees, as Triton's patching finds them."""
    return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)


def skip_patching_inside_launches() -> bool:
    """Install the shortcut; False (and nothing changed) where this Triton lacks what it wraps."""
    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "skips_inside_launches", False):
        return False
    patched: list[frozenset[int]] = []                    # what the launch in progress has patched (empty: none)

    class LaunchScope(scope_type):
        def restore(self) -> None:
            super().restore()
            patched.clear()

    def patch_once(fn):
        kind = languages(fn)
        if patched and kind in patched:
            return scope_type()                           # a helper inside a launch, its languages patched already
        scope = patch_lang(fn)
        if not patched:                                   # the launch itself: its scope ends it
            scope.__class__ = LaunchScope
        patched.append(kind)
        return scope
    patch_once.skips_inside_launches = True
    interpreter._patch_lang = patch_once
    return True
