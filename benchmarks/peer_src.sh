#!/usr/bin/env bash
# Fill .peer/Fast-dLLM with what benchmarks/gpu.py imports from NVlabs/Fast-dLLM: its llada/
# sources (generate.py, model/modeling_llada.py, model/configuration_llada.py and their
# siblings, about 200 kB), taken with `git archive` from a checkout or a bare repository of it,
# and the commit they came from (COMMIT, which gpu.py records as the peer's commit). .peer/ is
# ignored by git; a GPU lease carries it beside the working tree (benchmarks/gpu_lease.sh).
#   bash benchmarks/peer_src.sh PATH/TO/Fast-dLLM [REV (default HEAD)] [DEST (default .peer/Fast-dLLM)]
set -euo pipefail
src=${1:?usage: bash benchmarks/peer_src.sh FAST_DLLM_REPO [REV] [DEST]}
rev=${2:-HEAD}
dest=${3:-.peer/Fast-dLLM}
commit=$(git -C "$src" rev-parse --verify --quiet "$rev^{commit}" 2>/dev/null) || {
  echo "error: $src has no commit $rev (is it a git checkout or bare repository of Fast-dLLM?)" >&2; exit 2; }
git -C "$src" cat-file -e "$commit:llada/generate.py" 2>/dev/null || {
  echo "error: $src at $commit has no llada/generate.py: not NVlabs/Fast-dLLM" >&2; exit 2; }
mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d "$(dirname "$dest")/.peer-src.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# The llada tree alone (`REV:llada`): nothing else of the repository is read.
git -C "$src" archive --prefix=llada/ "$commit:llada" | tar -x -C "$tmp"
echo "$commit" > "$tmp/COMMIT"
rm -rf "$dest"
chmod 755 "$tmp"
mv "$tmp" "$dest"
trap - EXIT
echo "$dest: llada/ of $commit ($(find "$dest/llada" -type f | wc -l) files)"
