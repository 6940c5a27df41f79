# Sourced by scripts/demo.sh and scripts/test.sh: install into the active virtual environment, or into .venv at the
# repository root (made on first use), never into the system Python (Debian's refuses pip, PEP 668).
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python3 ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
