#!/bin/sh
# pdm's pre_run hook (pyproject.toml): bring the environment in step with pdm.lock, but only
# when pdm.lock or pyproject.toml changed since the last sync here, or the environment is new.
# A copy of both files, kept in the environment, says what it was last synced with; comparing
# it costs milliseconds, where `pdm sync` costs seconds on every `pdm run`.
#
#   sh scripts/sync-if-changed.sh {pdm}
#
# pdm expands {pdm} to the command that runs itself, `<its Python> -m pdm`, so the hook works
# when pdm is not on PATH. Ctrl-C during the sync prints `interrupted` and exits with 130; the
# next command syncs again. Run from the project's root (pdm runs hooks there).

trap 'echo interrupted >&2; exit 130' INT
stamp="${VIRTUAL_ENV:-.venv}/.tiny-llm-synced"
if cat pdm.lock pyproject.toml | cmp -s - "$stamp" 2>/dev/null; then
    exit 0
fi
rm -f "$stamp"
# pdm's own main, so that Ctrl-C ends it without a traceback
"$1" -c '
import sys
from pdm.core import main
try:
    main(sys.argv[1:])
except KeyboardInterrupt:
    sys.exit(130)
' sync --quiet -G dev -G book || exit $?
stamp="${VIRTUAL_ENV:-.venv}/.tiny-llm-synced"  # the first sync may have made .venv
if [ -d "$(dirname "$stamp")" ]; then
    cat pdm.lock pyproject.toml > "$stamp"
fi
