# Sourced: unpacks the server bundle of scripts/pack_server.py and puts it on this shell's paths.
#   source scripts/unpack_server.sh [BUNDLE [DEST]]
# BUNDLE: default .bundle/server-py<this python3's version>.tar.xz; DEST: default ${TMPDIR:-/tmp}/lora_llm_server.
# Exports LORA_LLM_STUB_VENV where this Python's numpy is 2 (stub_venv, below), PYTHONPATH (tritonserver as nvidia-pytriton lays it out, tritonclient, the OpenAI API's packages),
# PATH and LD_LIBRARY_PATH (perf_analyzer), LORA_LLM_SERVER_BUNDLE (DEST/server). Then checks what the machine must
# provide itself, the target Python's libpython for the Python backend's stub, and says where it looked.
# Returns 1 when the bundle or the library is missing.
# tritonserver 2.51's Python backend stub reads arrays through numpy 1's C layout (under numpy 2 every tensor it makes
# is empty): a venv of this Python for the stub, the bundle's numpy 1 first, then everything this Python sees (a .pth).
# The stub finds its Python through python3 on PATH (scripts/launch_server.py puts LORA_LLM_STUB_VENV's bin first).
stub_venv() {
  local python=$1 dest=$2
  "$python" -m venv --without-pip "$dest/stub-venv" || return 1
  local site
  site="$("$dest/stub-venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp -r "$dest/server/stub-site/." "$site/"
  "$python" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$site/zz_machine.pth"
  export LORA_LLM_STUB_VENV="$dest/stub-venv"
  echo "unpack_server: $python has numpy $("$python" -c 'import numpy; print(numpy.__version__)'); the stub runs" \
       "in $LORA_LLM_STUB_VENV with numpy $("$dest/stub-venv/bin/python3" -c 'import numpy; print(numpy.__version__)')"
}

unpack_server() {
  local python="${PYTHON:-python3}"
  local version
  version="$("$python" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')"
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local bundle="${1:-$root/.bundle/server-py$version.tar.xz}" dest="${2:-${TMPDIR:-/tmp}/lora_llm_server}"
  if [ ! -f "$bundle" ]; then
    echo "unpack_server: no bundle at $bundle (scripts/pack_server.py --python $version builds it)"
    return 1
  fi
  rm -rf "$dest" && mkdir -p "$dest"
  tar -C "$dest" -xJf "$bundle" || return 1
  local packed
  packed="$(cat "$dest/server/PYTHON")"
  if [ "$packed" != "$version" ]; then
    echo "unpack_server: $bundle is for Python $packed, this $python is $version"
    return 1
  fi
  export LORA_LLM_SERVER_BUNDLE="$dest/server"
  export PYTHONPATH="$dest/server/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$dest/server/bin:$PATH"
  export LD_LIBRARY_PATH="$dest/server/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local stub="$dest/server/site/pytriton/tritonserver/python_backend_stubs/$version/triton_python_backend_stub"
  local libdir
  libdir="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
  local missing
  missing="$(LD_LIBRARY_PATH="$libdir:$LD_LIBRARY_PATH" ldd "$stub" | grep "not found" || true)"
  if [ -n "$missing" ]; then
    echo "unpack_server: the Python $version stub lacks: $missing"
    echo "unpack_server: looked in $libdir (sysconfig LIBDIR of $python), LD_LIBRARY_PATH and ldconfig's cache:"
    ldconfig -p 2>/dev/null | grep -i "libpython$version" || echo "  (no libpython$version in ldconfig's cache)"
    return 1
  fi
  if "$python" -c 'import sys, numpy; sys.exit(int(numpy.__version__.split(".")[0]) < 2)' 2>/dev/null; then
    stub_venv "$python" "$dest" || return 1
  fi
  echo "unpack_server: tritonserver from $bundle in $dest/server (Python $version, libpython from" \
       "$(LD_LIBRARY_PATH="$libdir:$LD_LIBRARY_PATH" ldd "$stub" | awk '/libpython/ {print $3}'))"
}
unpack_server "$@"
