# shellcheck shell=bash
# Resume a SLURM job submitted with --requeue from the newest checkpoint ckptier proves now.
#
# Source it at the top of the batch script, before srun, so that every
# (re)start of the job -- the first launch, a requeue after preemption or a
# node failure -- asks the catalog again:
#
#     #SBATCH --requeue
#     export CKPTIER_JOB=llama-7b                     # the job's name in the catalog
#     export CKPTIER_RESUME_DEST=/scratch/$USER/resume  # where an archive-only checkpoint is fetched
#     source examples/slurm_requeue.sh
#     srun python train.py ${CKPTIER_RESUME_PATH:+--resume-from "$CKPTIER_RESUME_PATH"}
#
# It runs `ckptier resume --job "$CKPTIER_JOB" --dest "$CKPTIER_RESUME_DEST" --json`
# (the catalog from $CKPTIER_CATALOG_URL, the config from $CKPTIER_CONFIG as
# always) and, by its exit status:
#
#   0  exports CKPTIER_RESUME_PATH (the directory to load from) and
#      CKPTIER_RESUME_STEP (its step): the newest checkpoint proven now;
#   1  nothing of the job can be proven (a first launch, or every checkpoint
#      failed its proof): unsets both and says so, and the job starts from
#      scratch;
#   2+ a usage or catalog error: says so and returns that status, so that the
#      batch script (under `set -e`) stops rather than train from scratch over
#      a run it could have resumed.
#
# Every call is recorded as a recovery event (`ckptier resume --job J --stats`).
# CKPTIER (default `ckptier`) names the command, CKPTIER_PYTHON (default
# `python3`) the interpreter that reads its JSON answer, CKPTIER_RESUME_ARGS
# any extra options (`--quick`, `--drilled`).

ckptier_resume_slurm() {
    local job="${CKPTIER_JOB:-${SLURM_JOB_NAME:-}}"
    if [[ -z "$job" ]]; then
        echo "slurm_requeue.sh: no job to resume: set CKPTIER_JOB to the job's name in the catalog" >&2
        return 2
    fi
    local dest="${CKPTIER_RESUME_DEST:-${TMPDIR:-/tmp}/ckptier-resume-${SLURM_JOB_ID:-$$}}"
    local -a cmd extra
    read -r -a cmd <<< "${CKPTIER:-ckptier}"
    read -r -a extra <<< "${CKPTIER_RESUME_ARGS:-}"
    local answer rc=0
    answer="$("${cmd[@]}" resume --job "$job" --dest "$dest" --json "${extra[@]}")" || rc=$?
    case "$rc" in
        0)
            local fields
            fields="$(printf '%s' "$answer" | "${CKPTIER_PYTHON:-python3}" -c \
                'import json, sys; a = json.load(sys.stdin); print(a["step"]); print(a["path"])')" || return 2
            CKPTIER_RESUME_STEP="${fields%%$'\n'*}"
            CKPTIER_RESUME_PATH="${fields#*$'\n'}"
            export CKPTIER_RESUME_STEP CKPTIER_RESUME_PATH
            echo "ckptier: $job resumes from step $CKPTIER_RESUME_STEP at $CKPTIER_RESUME_PATH" \
                 "(restart ${SLURM_RESTART_COUNT:-0})" >&2
            ;;
        1)
            unset CKPTIER_RESUME_STEP CKPTIER_RESUME_PATH
            echo "ckptier: $job has no checkpoint proven now: starting from scratch" >&2
            ;;
        *)
            echo "ckptier: resume of $job failed (exit $rc): not starting" >&2
            return "$rc"
            ;;
    esac
}

ckptier_resume_slurm
