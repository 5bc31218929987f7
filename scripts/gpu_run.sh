#!/usr/bin/env bash
# Run on the GPU machine (device tool) from a snapshot of one commit, so files other engineers
# are still editing in the working tree never reach the run:
#   bash scripts/gpu_run.sh COMMIT 'command ...'
# The snapshot is extracted to /tmp/lm (wheels in .whl/ and .gpu-stage/ come along); then the
# command runs there with $OUT pointing at the device tool's output folder.
set -uo pipefail
commit=$1; shift
src=$PWD
rm -rf /tmp/lm && mkdir -p /tmp/lm
if [ -d .git ]; then
  git archive "$commit" | tar -x -C /tmp/lm || exit 3
else
  echo "no .git on this machine: running the working tree as sent"; cp -r . /tmp/lm
fi
[ -d .whl ] && cp -r .whl /tmp/lm/
cd /tmp/lm && bash -c "$*"
