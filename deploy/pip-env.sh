# Sourced by deploy/Dockerfile's build steps: pip settings from the staged build extras.
# ca.crt: the CA bundle pip must trust; wheels/: local wheels (torch's CPU build).
X=/tmp/build-extras
if [ -s "$X/ca.crt" ]; then export PIP_CERT="$X/ca.crt"; fi
if [ -d "$X/wheels" ]; then export PIP_FIND_LINKS="$X/wheels"; fi
if [ -z "${PIP_INDEX_URL:-}" ]; then unset PIP_INDEX_URL; fi
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180
