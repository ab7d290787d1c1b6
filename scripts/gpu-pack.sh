#!/usr/bin/env bash
# gpu-pack.sh -- the last command of a device call: every file under $OUT (the gpu-*.sh steps
# write a log per run, tens of them) into one archive, $OUT/logs.tar.gz, and the files removed,
# so that everything comes back (the device tool returns at most 8 files from $OUT).  Files of
# more than PACK_MAX_MB (8) MiB are left out of the archive and kept as they are (a model's
# logits dump is for comparing there, not for bringing back); one line lists them.
#   bash scripts/gpu-pack.sh        (OUT as the device sets it)
set -uo pipefail
OUT=${OUT:?gpu-pack: OUT is not set}
cd "$OUT" || exit 2
max=$(( ${PACK_MAX_MB:-8} * 1024 * 1024 ))
if [ -f logs.tar.gz ]; then   # a second pack in one call: the first archive's files back in place
  tar --skip-old-files -xzf logs.tar.gz && rm -f logs.tar.gz   # (a file written since wins)
fi
list=$(find . -type f ! -name logs.tar.gz -size -"$((max + 1))"c | sort)
big=$(find . -type f ! -name logs.tar.gz -size +"$max"c | sort)
[ -n "$big" ] && echo "gpu-pack: kept out of the archive (over ${PACK_MAX_MB:-8} MiB): $(echo $big)"
[ -z "$list" ] && { echo "gpu-pack: nothing to pack"; exit 0; }
echo "$list" | tar -czf logs.tar.gz -T - || { echo "gpu-pack: tar failed; the files stay"; exit 1; }
echo "$list" | xargs rm -f
find . -mindepth 1 -type d -empty -delete
echo "gpu-pack: $(echo "$list" | wc -l) files in $OUT/logs.tar.gz ($(stat -c %s logs.tar.gz) bytes)"
