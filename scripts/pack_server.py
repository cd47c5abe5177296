"""Pack the server for a machine without network (a GPU machine with Python, PyTorch and grpcio, and no
tritonserver): one compressed bundle, built from this project's .venv, that travels with the repository copy.

    python scripts/pack_server.py [--python 3.12] [--out .bundle/server-py3.12.tar.xz] [--level 6]

What it holds, under server/:
  site/pytriton/tritonserver/   tritonserver from nvidia-pytriton: bin/, the Python backend, the local cache, and the
                                stub of the target Python only
  site/nvidia_pytriton.libs/    the shared libraries those link (by relative rpath), no others
  site/<packages>               tritonclient and what our clients, the OpenAI API and guided decoding need that a bare
                                PyTorch machine lacks (rapidjson, fastapi, pydantic, uvicorn, xgrammar, ...), for the
                                target Python: copied from .venv when it is that Python, else the same versions fetched
                                from PyPI; pack_server exits naming any requirement neither packed nor on the machine
  bin/perf_analyzer             stripped, with the two libraries it wants under the names it wants (lib/)
  stub-site/                    numpy 1 for the Python backend's stub where the machine's numpy is 2 (STUB_PACKAGES)
  tokenizer/                    the default model's tokenizer files, where they are built (text checks on
                                random weights of its shape)
scripts/unpack_server.sh unpacks it and says what the machine must still provide (the target's libpython).
"""
import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(sysconfig.get_paths()["purelib"])
# what a machine with PyTorch (and MACHINE_HAS) lacks: each of their requirements is one or the other
PACKAGES = ("tritonclient", "python-rapidjson", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core",
            "annotated-types", "annotated-doc", "typing-inspection", "opentelemetry-api", "xgrammar", "apache-tvm-ffi")
MACHINE_HAS = ("torch", "triton", "transformers", "numpy", "grpcio", "protobuf", "httpx", "anyio", "jinja2",
               "prometheus-client", "typing-extensions", "urllib3", "click", "h11")
# the Python backend stub of tritonserver 2.51 reads numpy's arrays through the numpy 1 C layout: under numpy 2 every
# tensor it makes from an array is empty. Where the target's numpy is 2, the stub runs with this one (unpack_server.sh)
STUB_PACKAGES = ("numpy",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def needed(binary: Path) -> list[str]:
    """The sonames an ELF file links (readelf -d)."""
    out = subprocess.run(["readelf", "-d", str(binary)], check=True, capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def library_closure(binaries: list[Path], libs: Path) -> set[str]:
    """The files of `libs` that `binaries` need, directly or through each other."""
    present = {p.name for p in libs.iterdir()}
    todo, found = list(binaries), set()
    while todo:
        for name in needed(todo.pop()):
            if name in present and name not in found:
                found.add(name)
                todo.append(libs / name)
    return found


def copy_server(stage: Path, version: str) -> None:
    pytriton = SITE / "pytriton" / "tritonserver"
    out = stage / "site" / "pytriton"
    for part in ("bin", "backends/python", "caches", f"python_backend_stubs/{version}"):
        shutil.copytree(pytriton / part, out / "tritonserver" / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (out / "__init__.py").write_text('"""tritonserver from nvidia-pytriton, packed by scripts/pack_server.py (not the '
                                     'pytriton API)."""\n')
    binaries = [p for p in (out / "tritonserver").rglob("*") if p.is_file() and not p.suffix == ".py"]
    libs = SITE / "nvidia_pytriton.libs"
    (stage / "site" / libs.name).mkdir()
    for name in sorted(library_closure(binaries, libs)):
        shutil.copy2(libs / name, stage / "site" / libs.name / name)


def copy_packages(site: Path, version: str, packages: tuple[str, ...]) -> None:
    """`packages` for the target Python into `site`: the venv's own files, or the same versions from PyPI for another
    Python."""
    if version == f"{sys.version_info.major}.{sys.version_info.minor}":
        for name in packages:
            dist = importlib.metadata.distribution(name)
            for file in dist.files or []:
                path = Path(dist.locate_file(file))
                if path.is_file() and "__pycache__" not in file.parts and not str(file).startswith(".."):
                    (site / file).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, site / file)
        return
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in packages]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                    "--only-binary=:all:", "--implementation", "cp", "--python-version", version, *platforms,
                    "--target", str(site), *pins], check=True)
    shutil.rmtree(site / "bin", ignore_errors=True)            # the wheels' scripts: perf_analyzer comes stripped


def check_requirements(packages: tuple[str, ...]) -> None:
    """Exits naming any requirement of `packages` that is neither packed nor on the machine (a GPU machine once
    lacked xgrammar, then fastapi's opentelemetry-api: the engine, then the OpenAI API, failed to start there)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    known = {canonicalize_name(name) for name in packages + MACHINE_HAS}
    missing = sorted({f"{name} needs {req.name}" for name in packages for req in map(Requirement,
                      importlib.metadata.requires(name) or []) if canonicalize_name(req.name) not in known and
                      (req.marker is None or req.marker.evaluate({"extra": ""}))})
    if missing:
        sys.exit(f"pack_server: not packed and not on the machine: {'; '.join(missing)} (PACKAGES, MACHINE_HAS)")


def strip_binaries(stage: Path) -> None:
    """Symbols off every ELF file (tritonserver's 19.7 MB binary is 12 MB of them)."""
    for path in stage.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.read_bytes()[:4] == b"\x7fELF":
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)


def copy_perf_analyzer(stage: Path) -> None:
    """perf_analyzer 2.51 links libb64.so.0d and libcudart.so.12: nvidia-pytriton's copies under those names."""
    binary = Path(sys.prefix) / "bin" / "perf_analyzer"
    if not binary.is_file():
        print(f"pack_server: no {binary}: the bundle has no perf_analyzer")
        return
    (stage / "bin").mkdir()
    (stage / "lib").mkdir()
    subprocess.run(["strip", "-o", str(stage / "bin" / "perf_analyzer"), str(binary)], check=True)
    libs = SITE / "nvidia_pytriton.libs"
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        shutil.copy2(next(libs.glob(pattern)), stage / "lib" / name)


def copy_tokenizer(stage: Path) -> None:
    model = ROOT / "models" / "smollm2-135m-instruct"
    files = [model / name for name in TOKENIZER_FILES if (model / name).is_file()]
    if files:
        (stage / "tokenizer").mkdir()
        for file in files:
            shutil.copy2(file, stage / "tokenizer" / file.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the target machine's Python (its stub, its packages)")
    parser.add_argument("--out", type=Path, help="default: .bundle/server-py<python>.tar.xz")
    parser.add_argument("--level", type=int, default=6, help="xz level (0: fast, for tests)")
    args = parser.parse_args()
    out = (args.out or ROOT / ".bundle" / f"server-py{args.python}.tar.xz").resolve()
    if not (SITE / "pytriton" / "tritonserver" / "python_backend_stubs" / args.python).is_dir():
        sys.exit(f"pack_server: nvidia-pytriton in {SITE} has no stub for Python {args.python}")
    with tempfile.TemporaryDirectory(prefix="pack_server-") as tmp:
        stage = Path(tmp) / "server"
        stage.mkdir()
        check_requirements(PACKAGES)
        copy_server(stage, args.python)
        copy_packages(stage / "site", args.python, PACKAGES)
        copy_packages(stage / "stub-site", args.python, STUB_PACKAGES)
        shutil.rmtree(stage / "stub-site" / "numpy" / "tests", ignore_errors=True)
        copy_perf_analyzer(stage)
        copy_tokenizer(stage)
        strip_binaries(stage)
        (stage / "PYTHON").write_text(args.python + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        subprocess.run(["tar", "-C", tmp, "-cf", str(partial), "--use-compress-program", f"xz -T0 -{args.level}",
                        "server"], check=True)
        partial.replace(out)
    print(f"pack_server: {out} ({out.stat().st_size / 2**20:.1f} MiB) for Python {args.python}")


if __name__ == "__main__":
    main()
