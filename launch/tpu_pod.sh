#!/usr/bin/env bash
# Drive a delta_jax run on a Cloud TPU VM slice (v4 / v5p / v5e / v6e) with gcloud.
#
#   launch/tpu_pod.sh [--dry-run] COMMAND [options] [-- section.key=value ...]
#
# Commands:
#   create    create the TPU VM slice
#   install   copy this checkout to every worker and pip-install it with jax[tpu]
#   run       start `delta-jax train --config CONFIG` on every worker (in the background)
#   logs      follow one worker's training log (default worker 0)
#   delete    delete the slice
#
# Options (flags, or the environment variables in brackets):
#   --name NAME          slice name                      [TPU_NAME]   (required)
#   --zone ZONE          e.g. us-east5-a                 [TPU_ZONE]   (required)
#   --project PROJECT    gcloud project                  [TPU_PROJECT] (default: gcloud's)
#   --type TYPE          accelerator type, e.g. v5p-64   [TPU_TYPE]   (default v5p-64)
#   --version VERSION    TPU VM software version         [TPU_VERSION] (default: by generation)
#   --spot               create a Spot slice
#   --config FILE        training config (run)           [TPU_CONFIG] (default configs/qwen3_8b_delta.yaml)
#   --run-dir DIR        run.dir on a filesystem shared by all workers (run) [TPU_RUN_DIR]
#   --worker N           worker whose log to follow (logs) (default 0)
#   --source DIR         checkout to install (install) (default: this repository)
#   --dry-run            print the commands instead of running them
#
# Every worker runs the same command; JAX finds the other workers itself (TPU auto-detection in
# jax.distributed.initialize). Checkpoints are written by all workers together, so --run-dir must
# be shared (a gcsfuse-mounted bucket or Filestore), e.g. /mnt/runs/qwen3_8b_delta.
set -euo pipefail

DRY_RUN=0
NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
TYPE="${TPU_TYPE:-v5p-64}"
VERSION="${TPU_VERSION:-}"
SPOT=0
CONFIG="${TPU_CONFIG:-configs/qwen3_8b_delta.yaml}"
RUN_DIR="${TPU_RUN_DIR:-}"
WORKER=0
SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Expanded on the workers, not here.
LOG_FILE="\$HOME/delta_jax_train.log"
REMOTE_DIR="\$HOME/delta_jax"
ARCHIVE=/tmp/delta_jax_src.tar.gz
COMMAND=""
OVERRIDES=()

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
  echo "error: $*" >&2
  exit 2
}

# One argument as the shell would need it typed: bare when safe, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Runs a command, or prints it (one line, copy-pastable) under --dry-run.
run() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    local quoted=()
    local arg
    for arg in "$@"; do
      quoted+=("$(quote "${arg}")")
    done
    echo "+ ${quoted[*]}"
  else
    "$@"
  fi
}

default_version() {
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5e-* | v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "--type ${1}: expected v4-N, v5p-N, v5e-N (v5litepod-N) or v6e-N" ;;
  esac
}

# gcloud's accelerator name for v5e is v5litepod-N.
accelerator_type() {
  case "$1" in
    v5e-*) echo "v5litepod-${1#v5e-}" ;;
    *) echo "$1" ;;
  esac
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --name) NAME="${2:?--name needs a value}"; shift ;;
    --zone) ZONE="${2:?--zone needs a value}"; shift ;;
    --project) PROJECT="${2:?--project needs a value}"; shift ;;
    --type) TYPE="${2:?--type needs a value}"; shift ;;
    --version) VERSION="${2:?--version needs a value}"; shift ;;
    --spot) SPOT=1 ;;
    --config) CONFIG="${2:?--config needs a value}"; shift ;;
    --run-dir) RUN_DIR="${2:?--run-dir needs a value}"; shift ;;
    --worker) WORKER="${2:?--worker needs a value}"; shift ;;
    --source) SOURCE="${2:?--source needs a value}"; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    create | install | run | logs | delete)
      [[ -z "${COMMAND}" ]] || die "two commands given: ${COMMAND} and $1"
      COMMAND="$1" ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

[[ -n "${COMMAND}" ]] || die "no command given: create, install, run, logs or delete (see --help)"
[[ -n "${NAME}" ]] || die "--name (or TPU_NAME) is required"
[[ -n "${ZONE}" ]] || die "--zone (or TPU_ZONE) is required"
[[ "${WORKER}" =~ ^[0-9]+$ ]] || die "--worker ${WORKER}: expected a worker index"
[[ -n "${VERSION}" ]] || VERSION="$(default_version "${TYPE}")"

COMMON=(--zone="${ZONE}")
[[ -z "${PROJECT}" ]] || COMMON+=(--project="${PROJECT}")

case "${COMMAND}" in
  create)
    EXTRA=()
    [[ "${SPOT}" == 0 ]] || EXTRA+=(--spot)
    run gcloud compute tpus tpu-vm create "${NAME}" "${COMMON[@]}" \
      --accelerator-type="$(accelerator_type "${TYPE}")" --version="${VERSION}" "${EXTRA[@]}"
    ;;
  install)
    [[ -f "${SOURCE}/pyproject.toml" ]] || die "--source ${SOURCE}: no pyproject.toml there"
    run tar -czf "${ARCHIVE}" -C "${SOURCE}" --exclude=.git --exclude=runs --exclude='*.egg-info' .
    run gcloud compute tpus tpu-vm scp "${ARCHIVE}" "${NAME}:${ARCHIVE}" "${COMMON[@]}" --worker=all
    run gcloud compute tpus tpu-vm ssh "${NAME}" "${COMMON[@]}" --worker=all --command \
      "mkdir -p ${REMOTE_DIR} && tar -xzf ${ARCHIVE} -C ${REMOTE_DIR} && pip install -q -U 'jax[tpu]' && pip install -q -e ${REMOTE_DIR}"
    ;;
  run)
    TRAIN="delta-jax train --config ${CONFIG}"
    [[ -z "${RUN_DIR}" ]] || TRAIN+=" run.dir=${RUN_DIR}"
    for override in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do
      TRAIN+=" $(printf '%q' "${override}")"
    done
    run gcloud compute tpus tpu-vm ssh "${NAME}" "${COMMON[@]}" --worker=all --command \
      "cd ${REMOTE_DIR} && nohup ${TRAIN} > ${LOG_FILE} 2>&1 < /dev/null &"
    ;;
  logs)
    run gcloud compute tpus tpu-vm ssh "${NAME}" "${COMMON[@]}" --worker="${WORKER}" --command \
      "tail -n +1 -F ${LOG_FILE}"
    ;;
  delete)
    run gcloud compute tpus tpu-vm delete "${NAME}" "${COMMON[@]}" --quiet
    ;;
esac
