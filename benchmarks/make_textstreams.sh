#!/bin/bash
# Build the real-text token streams of `plestore bench hitrate` / `--text` (into textstreams/,
# ignored by git: ~12 MB). Everything comes from package registries; nothing at run time.
#   English: Python 3.11 documentation sources (Debian python3.11-doc), the Debian Reference
#            (debian-reference-en), the English fortune files (fortunes); GPT-2 tokens
#   German:  the Debian Reference (debian-reference-de), German fortunes (fortunes-de);
#            tokens of whisper's multilingual vocabulary
# The tokenizer files are the openai-whisper sdist's whisper/assets/*.tiktoken, read by tiktoken.
set -eu
work=${WORK:-/tmp/textstreams-build}
mkdir -p "$work" textstreams
apt-get install -y -q python3.11-doc debian-reference-en debian-reference-de fortunes \
  fortunes-de > /dev/null
pip download openai-whisper==20250625 --no-deps --no-binary :all: -d "$work" -q
tar xzf "$work"/openai_whisper-20250625.tar.gz -C "$work"
pip install --target "$work/pylib" tiktoken -q
assets=$work/openai_whisper-20250625/whisper/assets
f=/usr/share/games/fortunes
en_fortunes=$(ls $f | grep -vE '\.(dat|u8)$' | grep -vxE 'de|off' | sed "s|^|$f/|")
export PYTHONPATH=$PWD/src:$work/pylib
python3 -m plestore text textstreams/en /usr/share/doc/python3.11/html/_sources \
  /usr/share/debian-reference/debian-reference.en.txt.gz $en_fortunes \
  --tokenizer "$assets/gpt2.tiktoken"
python3 -m plestore text textstreams/de \
  /usr/share/debian-reference/debian-reference.de.txt.gz $f/de \
  --tokenizer "$assets/multilingual.tiktoken"
