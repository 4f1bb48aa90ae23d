# Sourced by scripts/demo, scripts/test, scripts/launch and scripts/bench_all: make sure .venv
# exists and holds this checkout installed with the given extras.
# Usage: kvswap_bootstrap [EXTRAS]   (sets $PY to the venv's python)
kvswap_bootstrap() {
    local extras="${1:-}"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local venv="${KVSWAP_VENV:-$root/.venv}"
    if [ ! -x "$venv/bin/python" ]; then
        echo "kvswap: creating $venv" >&2
        python3 -m venv "$venv" || { echo "kvswap: python3 -m venv failed (install python3-venv)" >&2; return 1; }
    fi
    PY="$venv/bin/python"
    # Reinstall only when the build inputs (metadata, the compiled copy loop) changed
    # or the extras differ from last time.
    local stamp="$venv/.kvswap-installed"
    local want
    want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root"/kernels/*.c "$root"/client/*.c | sha256sum | cut -c1-16) ${extras}"
    if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
        local spec="$root"
        [ -n "$extras" ] && spec="$root[$extras]"
        echo "kvswap: installing ${spec} into $venv" >&2
        "$PY" -m pip install --disable-pip-version-check -q -e "$spec" || return 1
        echo "$want" >> "$stamp"
    fi
}
