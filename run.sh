#!/usr/bin/env bash
# The project's two entry points; each sets up .venv (pinned, from the registries) first.
#   bash run.sh main [ARGS]   the main job: the torch/JAX cross-check on the embedded default
#   bash run.sh test [ARGS]   the test suite (CPU, 2 forced XLA host devices; Pallas and Triton kernels
#                             interpreted; two pytest workers, one per core: most tests are single-threaded;
#                             an idle worker takes tests queued for the other: the slow ones do not end the run alone)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
stamp=.venv/.installed-$(cat requirements.txt requirements-test.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    if [ -x .venv/bin/python ]; then
        echo "run.sh: updating .venv (requirements changed; a minute or more)..." >&2
    else
        echo "run.sh: setting up .venv (first run, a few minutes)..." >&2
        "$PY" -m venv .venv
    fi
    .venv/bin/pip install -q -r requirements.txt -r requirements-test.txt
    # moshi is the external oracle of the tests: its transformer module needs only torch + einops.
    .venv/bin/pip install -q --no-deps "moshi==0.2.13"
    .venv/bin/pip install -q --no-deps -e .
    rm -f .venv/.installed-* && touch "$stamp"
fi
cmd=${1:-}
shift || true
case "$cmd" in
    main) exec .venv/bin/personaplex-jax crosscheck "$@" ;;
    test) XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=2} TRITON_INTERPRET=1 exec .venv/bin/python -m pytest -n 2 --dist worksteal "$@" ;;
    *) echo "usage: bash run.sh main|test [ARGS]" >&2; exit 2 ;;
esac
