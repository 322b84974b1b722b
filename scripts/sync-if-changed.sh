#!/bin/sh
# pdm's pre_run hook (pyproject.toml): bring the environment in step with pdm.lock, but only
# when pdm.lock or pyproject.toml changed since the last sync here, or the environment is new.
# A copy of both files, kept in the environment, says what it was last synced with; comparing
# it costs milliseconds, where `pdm sync` costs seconds on every `pdm run`.
#
#   sh scripts/sync-if-changed.sh {pdm}
#
# The arguments are the pdm that runs the hook (pdm passes `{pdm}`: its own Python and
# `-m pdm`), so the hook works when pdm is not on PATH. Run from the project's root.

trap 'echo interrupted >&2; exit 130' INT
stamp="${VIRTUAL_ENV:-.venv}/.tiny-llm-synced"
if cat pdm.lock pyproject.toml | cmp -s - "$stamp" 2>/dev/null; then
    exit 0
fi
"$@" sync --quiet -G dev -G book || exit $?
stamp="${VIRTUAL_ENV:-.venv}/.tiny-llm-synced"
if [ -d "$(dirname "$stamp")" ]; then
    cat pdm.lock pyproject.toml > "$stamp"
fi
