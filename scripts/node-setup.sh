#!/usr/bin/env bash
# orch's node setup: every recipe's `setup:` runs `bash scripts/node-setup.sh EXTRAS` (EXTRAS: train, train,gpu
# or train,gpu,vllm) from the repository root, with the task's envs and secrets.
#
# 1. uv, installed here if the image lacks it (pip, else astral's installer).
# 2. A virtual environment, ORCH_VENV (default ~/.orch/venv), which every `run:` uses. Created from the image's
#    python when it is >= 3.11 and already holds uv.lock's torch (kept: system site-packages, no download of
#    several GB), else from a uv-managed Python 3.12 (TRL 1.16 needs 3.11; SkyPilot's default images have 3.10).
#    An existing ORCH_VENV is installed into as it is. On SkyPilot's Slurm nodes, whose $HOME is per cluster, the
#    default is one environment per uv.lock and image python on the account's home
#    (~/.cache/orch/venvs/<key>, ~/.orch/venv links to it): a new cluster of the account finds it installed.
#    `bash scripts/node-setup.sh --print-venv` prints the environment a setup here would use.
# 3. Exactly uv.lock's versions of orch[EXTRAS] (uv export --frozen, hashes required); torch is kept when the
#    environment holds the locked version (any build: +cu128, +cpu; on a node with NVIDIA GPUs not a CPU build,
#    whose ranks would each train alone on the CPU), else the locked torch is installed: the
#    rest of the lock was resolved against it. A reused cluster whose environment already holds this lock and
#    these extras skips all of it.
# 4. The recipe's model and dataset, downloaded once per node in parallel into the Hugging Face cache the training
#    processes read (python -m orchestrator.train.prefetch), while the head node rehearses the cluster's rank roles
#    against accelerate, TRL and transformers (orch node --rehearse; ORCH_REHEARSAL=off skips it). A failed
#    rehearsal stops the download and the setup. After an install, the other nodes' `orch node --rehearse --warm`
#    compiles what their ranks import (uv installs without bytecode).
# With ORCH_TRACK set (orch run --track), the `track` extra (Trackio) is added to EXTRAS.
# Timings go to $ORCH_HOME/setup-<cluster>-node<rank>.times for the time-to-first-step breakdown.
set -euo pipefail

print_venv=
if [ "${1:-}" = --print-venv ]; then print_venv=1; shift; fi
extras="${1:-train}"
# --track (ORCH_TRACK=<project>): the nodes log to Trackio; only then is its extra installed
if [ -n "${ORCH_TRACK:-}" ] && [ "${ORCH_TRACK,,}" != off ] && [[ ",$extras," != *,track,* ]]; then
  extras="$extras,track"
fi
link=
if [ -z "${ORCH_VENV:-}" ]; then
  ORCH_VENV="${ORCH_HOME:-$HOME/.orch}/venv"
  account=$(getent passwd "$(id -u)" | cut -d: -f6 || true)
  account=${account%/}
  # SkyPilot's Slurm nodes: $HOME is <account home>/.sky_clusters/<cluster>, deleted with the cluster (not with a
  # set ORCH_HOME: the removal of unused environments below looks for the clusters' links at ~/.orch/venv)
  if [ -z "${ORCH_HOME:-}" ] && [ -n "$account" ] && [[ "$HOME" == "$account/.sky_clusters/"* ]] \
      && { [ -L "$ORCH_VENV" ] || [ ! -e "$ORCH_VENV" ]; }; then
    link=$ORCH_VENV
  fi
fi
ORCH_HOME="${ORCH_HOME:-$HOME/.orch}"
now() { date +%s.%N; }
started=$(now)
say() { echo "[orch] setup: $*"; }
# One timings file per node of each cluster: on Slurm every node of every cluster of the account shares the home, and
# one setup.times was truncated and appended by all of them at once (a node read another's records, or lost its own
# error line). The name is orch's core/timeline.setup_times_file, which the nodes' `orch node` reads back.
node_rank="${SKYPILOT_SETUP_NODE_RANK:-${SKYPILOT_NODE_RANK:-0}}"
rank_from=$([ -n "${SKYPILOT_SETUP_NODE_RANK:-}" ] && echo SKYPILOT_SETUP_NODE_RANK || echo SKYPILOT_NODE_RANK)
[[ "$node_rank" =~ ^[0-9]+$ ]] || { echo "orch: error: node rank '$node_rank' is not a number ($rank_from)" >&2; exit 2; }
cluster=$(printf '%s' "${SKYPILOT_CLUSTER_INFO:-}" | sha256sum | cut -c1-12)
times="$ORCH_HOME/setup-$cluster-node$node_rank.times"
[ -f uv.lock ] || { echo "orch: error: no uv.lock here ($(pwd)); run the setup from the repository root" >&2; exit 2; }

locked_torch=$(awk '/^name = "torch"$/ { getline; gsub(/"/, "", $3); print $3; exit }' uv.lock)
key=$(cat uv.lock pyproject.toml | sha256sum | cut -c1-16)
# A node with NVIDIA GPUs (nvidia-smi lists one) keeps only a CUDA build of torch: on a CPU build (+cpu) every rank
# would see no GPU and train alone on the CPU (orch's core/torch_build.py), so the lock's torch is installed instead.
nvidia_gpus=
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then nvidia_gpus=1; fi
has_locked_torch() {  # python: 0 when it holds torch at the locked version (any local build: +cu128, +cpu), 1 when
  # not, 3 when it is a build without CUDA on a node with NVIDIA GPUs (torch/version.py read, torch not imported)
  "$1" -c "import importlib.util, re, sys; from importlib.metadata import version
if version('torch').split('+')[0] != '$locked_torch': sys.exit(1)
if '$nvidia_gpus':
    path = list(importlib.util.find_spec('torch').submodule_search_locations)[0] + '/version.py'
    sys.exit(0 if re.search(r\"^cuda\\b[^=\\n]*= *'\", open(path).read(), re.M) else 3)" 2>/dev/null
}
# Before the lock's torch is installed (several GB): the newest CUDA this node's NVIDIA driver runs (nvidia-smi -q)
# against the CUDA of uv.lock's torch build (its cuda-toolkit). Minor version compatibility runs any 13.x on a 13.0
# driver, none on a 12.x one: torch would see no GPU (skypilot#9406: driver 535 and torch's cu130). orch's
# core/cuda_arch.check_node says the same of an environment's torch in the head node's rehearsal.
lock_cuda=$(awk '/^name = "cuda-toolkit"$/ { getline; gsub(/"/, "", $3); split($3, v, "."); print v[1] "." v[2]; exit }' \
  uv.lock)
driver_cuda=
if [ -n "$nvidia_gpus" ]; then
  driver_cuda=$(nvidia-smi -q 2>/dev/null \
    | sed -nE 's/^[[:space:]]*CUDA Version[[:space:]]*:[[:space:]]*([0-9]+\.[0-9]+).*/\1/p' | head -n 1)
fi
check_driver() {
  local knob="${ORCH_CUDA_ARCH_CHECK:-on}"
  [ -n "$driver_cuda" ] && [ -n "$lock_cuda" ] && [ "${knob,,}" != off ] || return 0
  [ "${driver_cuda%%.*}" -lt "${lock_cuda%%.*}" ] || return 0
  echo "orch: error: node $node_rank setup: this node's NVIDIA driver runs CUDA up to $driver_cuda (nvidia-smi -q)," \
    "and uv.lock's torch $locked_torch is a CUDA $lock_cuda build, which needs a driver for CUDA ${lock_cuda%%.*}:" \
    "torch would see no GPU; use an image with a newer driver, or one holding torch $locked_torch's CUDA 12.9 build" \
    "(12.6 for a V100), which the setup keeps (pip install torch==$locked_torch --index-url" \
    "https://download.pytorch.org/whl/cu129); ORCH_CUDA_ARCH_CHECK=off installs it anyway" >&2
  exit 2
}
image_python= image_has_torch= image_read= image_torch=
read_image() {  # the image's python3, and whether it is >= 3.11 with the locked torch (an environment is made from it)
  [ -z "$image_read" ] || return 0
  image_read=1
  image_python=$(command -v python3 || true)
  image_torch=1
  if [ -n "$image_python" ] && "$image_python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    has_locked_torch "$image_python" && image_torch=0 || image_torch=$?
  fi
  [ "$image_torch" != 0 ] || image_has_torch=1
}
if [ -n "$link" ]; then
  read_image
  # one per lock and image python (what the environment is made from): clusters of one lock share it, and nothing is
  # ever installed into it but that lock's packages (orch's own code comes from each cluster's workdir: `orch node`)
  made_from=$(printf '%s|%s|%s|%s' "$image_python" "$([ -z "$image_python" ] || "$image_python" --version 2>&1)" \
    "$image_has_torch" "$(uname -m)" | sha256sum | cut -c1-8)
  ORCH_VENV="$account/.cache/orch/venvs/$key-$made_from"
fi
if [ -n "$print_venv" ]; then echo "$ORCH_VENV"; exit 0; fi

# A failed step ends the setup with one `orch: error:` line, last, naming the step and quoting the failing tool's first
# error line (`orch run` and `orch logs` quote it as the job's failure; uv's other lines stay above it). Step 4 below
# records and prints its own errors and turns this off.
step="installing uv" last_error=
on_error() {
  local code=$?
  echo "orch: error: node $node_rank setup failed while $step (exit $code)${last_error:+: $last_error}" >&2
}
trap on_error ERR
uv_run() {  # uv, its messages shown as before (once it ends), its first error line kept for on_error
  local err code=0
  { err=$("${UV[@]}" "$@" 2>&1 >&3) || code=$?; } 3>&1
  [ -z "$err" ] || printf '%s\n' "$err" >&2
  # uv's first `error: ...` line, or its first `× ...` (a failed download or build): uv's error, in its words
  [ "$code" -eq 0 ] || last_error=$(printf '%s\n' "$err" \
    | sed -nE 's/^[[:space:]]*((error|ERROR): .*)$/\1/p; s/^[[:space:]]*×[[:space:]]*(.*)$/error: \1/p' | head -n 1)
  return "$code"
}

# 1. uv
if command -v uv >/dev/null 2>&1; then
  UV=(uv)
elif python3 -m uv --version >/dev/null 2>&1; then
  UV=(python3 -m uv)
else
  say "installing uv"
  if python3 -m pip install -q uv >/dev/null 2>&1 && python3 -m uv --version >/dev/null 2>&1; then
    UV=(python3 -m uv)
  else
    curl -LsSf https://astral.sh/uv/install.sh | sh >/dev/null
    UV=("$HOME/.local/bin/uv")
  fi
fi

step="preparing $ORCH_HOME"
mkdir -p "$ORCH_HOME"
echo "started=$started" > "$times"
stamp="$ORCH_VENV/.orch-setup-$key-${extras//,/-}"

# One node installs at a time: on Slurm every node shares the home (and so ORCH_VENV); the others then find the stamp.
mkdir -p "$(dirname "$ORCH_VENV")"
locked=
if ! command -v flock >/dev/null 2>&1; then
  say "no flock on this node: nodes that share $ORCH_VENV may install into it at once"
elif ! { exec 9>"$ORCH_VENV.lock"; } 2>/dev/null; then
  echo "orch: error: node $node_rank setup: cannot write $ORCH_VENV.lock (the lock that lets one node install at a" \
    "time): make $(dirname "$ORCH_VENV") writable by $(id -un), or set ORCH_VENV to a directory under a writable" \
    "parent" >&2
  exit 2
else
  flock 9 && locked=1
fi
installed_here=
if [ -f "$stamp" ]; then
  say "$ORCH_VENV already holds uv.lock's orch[$extras] (installed by an earlier setup): nothing to install"
else
  installed_here=1
  # 2. the environment
  if [ ! -x "$ORCH_VENV/bin/python" ]; then
    read_image
    if [ -n "$image_has_torch" ]; then
      say "the image's $("$image_python" --version) holds torch $locked_torch: keeping it ($ORCH_VENV)"
      step="creating $ORCH_VENV"
      uv_run venv -q --python "$image_python" --system-site-packages "$ORCH_VENV"
    elif [ "$image_torch" = 3 ]; then
      say "creating $ORCH_VENV with Python 3.12: the image's torch $locked_torch is a CPU build, and this node has NVIDIA GPUs"
      step="creating $ORCH_VENV with Python 3.12"
      uv_run venv -q --python 3.12 "$ORCH_VENV"
    else
      say "creating $ORCH_VENV with Python 3.12 (the image's python is < 3.11 or lacks torch $locked_torch)"
      step="creating $ORCH_VENV with Python 3.12"
      uv_run venv -q --python 3.12 "$ORCH_VENV"
    fi
  fi
  py="$ORCH_VENV/bin/python"
  # 3. the lock
  has_locked_torch "$py" && torch_state=0 || torch_state=$?
  if [ "$torch_state" = 0 ]; then
    say "torch $locked_torch is there: kept"
  elif [ "$torch_state" = 3 ]; then
    check_driver
    say "torch $locked_torch in $ORCH_VENV is a CPU build, and this node has NVIDIA GPUs: installing the lock's (CUDA)"
    step="installing torch $locked_torch"
    uv_run pip install -q --python "$py" --reinstall-package torch "torch==$locked_torch"
  else
    check_driver
    say "installing torch $locked_torch (the lock's)"
    step="installing torch $locked_torch"
    uv_run pip install -q --python "$py" "torch==$locked_torch"
  fi
  requirements="$ORCH_HOME/requirements-${extras//,/-}.txt"
  extra_flags=()
  IFS=, read -ra names <<< "$extras"
  for name in "${names[@]}"; do extra_flags+=(--extra "$name"); done
  step="exporting uv.lock's orch[$extras]"
  uv_run export -q --frozen --no-emit-project --prune torch "${extra_flags[@]}" --format requirements-txt \
    -o "$requirements"
  say "installing uv.lock's orch[$extras] ($(grep -c '==' "$requirements") packages)"
  step="installing uv.lock's orch[$extras] into $ORCH_VENV"
  # DeepSpeed is an sdist whose build imports torch: build it against the environment's torch.
  uv_run pip install -q --python "$py" --no-deps --require-hashes --no-build-isolation-package deepspeed \
    -r "$requirements"
  # a copy, not editable: the environment may outlive this checkout (shared by clusters, each with its own workdir)
  step="installing orch from this checkout into $ORCH_VENV"
  uv_run pip install -q --python "$py" --no-deps --reinstall-package orch .
  touch "$stamp"
fi
# `orch node` runs the workdir's orch (orchestrator/cli.py starts it again from there); the environment's own `orch`
# only has to start. One installed editable by an earlier setup cannot once its checkout is gone (the cluster that
# made a shared environment was taken down): then a copy from this checkout replaces it.
if ! (cd / && "$ORCH_VENV/bin/python" -c "import orchestrator.cli") 2>/dev/null; then
  say "orch's own command from this checkout ($(pwd -P)): the one installed before is gone"
  step="installing orch from this checkout into $ORCH_VENV"
  uv_run pip install -q --python "$ORCH_VENV/bin/python" --no-deps --reinstall-package orch .
fi
if [ -n "$link" ]; then
  step="linking $link to $ORCH_VENV"
  if [ "$(readlink "$link" 2>/dev/null)" != "$ORCH_VENV" ]; then
    ln -sfn "$ORCH_VENV" "$link.$$" && mv -Tf "$link.$$" "$link"  # the `run:`'s ~/.orch/venv; a rename: atomic
  fi
  touch "$ORCH_VENV/.orch-used"
  # The account's environments of other locks (each 1 GB or more, on a home that often has a quota): one that no
  # cluster links to and no setup has used for 7 days is removed, under its own lock (a setup installing into it
  # holds it). Only directories a setup made and finished: named <key>-<image>, with a setup's stamp in them. Without
  # flock, nothing is removed.
  if [ -n "$locked" ]; then
    for old in "$(dirname "$ORCH_VENV")"/*; do
      [[ "${old##*/}" =~ ^[0-9a-f]{16}-[0-9a-f]{8}$ ]] && [ "$old" != "$ORCH_VENV" ] && [ -d "$old" ] \
        && [ ! -L "$old" ] && compgen -G "$old/.orch-setup-*" >/dev/null || continue
      used=$([ -e "$old/.orch-used" ] && echo "$old/.orch-used" || compgen -G "$old/.orch-setup-*" | head -n 1)
      [ -z "$(find "$used" -maxdepth 0 -mtime -7 2>/dev/null)" ] || continue
      linked=
      for other in "$account"/.sky_clusters/*/.orch/venv; do
        [ "$(readlink "$other" 2>/dev/null)" != "$old" ] || { linked=1; break; }
      done
      [ -z "$linked" ] || continue
      if { exec 8>"$old.lock"; } 2>/dev/null && flock -n 8; then
        # renamed first (atomic): a removal that fails half-way leaves no half environment under a name a setup uses
        mv -T "$old" "$old.removing-$$" && rm -rf "$old.removing-$$" \
          && say "removed $old: an environment of another lock that no cluster links to, unused for 7 days"
      fi
      exec 8>&-
    done
  fi
fi
[ -z "$locked" ] || flock -u 9
echo "installed=$(now)" >> "$times"

# 4. the model and the data download while the head node rehearses (the owners' code on this cluster's roles), each
#    recording its own end: the setup takes the longer of the two. Whichever fails first ends the setup, its own error
#    line last; the EXIT trap stops the other, so nothing this script started outlives it.
trap - ERR  # from here each part records its own error, printed once, last, by stop_both
fetching= rehearsing=
stop_both() {
  local code=$? pid
  for pid in $fetching $rehearsing; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # both record their refusal in the timings file instead of printing it: the first one, once, last (after a stopped
  # rehearsal's `orch: interrupted`)
  [ "$code" -eq 0 ] || sed -n 's/^error=//p' "$times" 2>/dev/null | head -n 1 >&2
}
trap stop_both EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -z "${ORCH_SKIP_PREFETCH:-}" ]; then
  HF_XET_HIGH_PERFORMANCE="${HF_XET_HIGH_PERFORMANCE:-1}" "$ORCH_VENV/bin/python" -m orchestrator.train.prefetch \
    --times "$times" &
  fetching=$!
fi
# --warm: this setup installed the environment, which uv leaves without bytecode; where no rehearsal here imports the
# training stack (every node but the head), orch node compiles what the ranks import, so they do not after the launch
"$ORCH_VENV/bin/orch" node --rehearse --times "$times" ${installed_here:+--warm} &
rehearsing=$!
while [ -n "$fetching$rehearsing" ]; do
  for job in rehearsing fetching; do
    pid=${!job}
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then  # ended: its status, kept by bash
      code=0
      wait "$pid" || code=$?
      printf -v "$job" '%s' ''
      [ "$code" -eq 0 ] || exit "$code"
    fi
  done
  [ -z "$fetching$rehearsing" ] || sleep 0.2
done
echo "done=$(now)" >> "$times"
say "done in $(awk -F= '{ t[$1] = $2 } END { printf "%.1f s", t["done"] - t["started"] }' "$times")"
