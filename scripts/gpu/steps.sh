#!/usr/bin/env bash
# Run a campaign's steps in order inside one device call of limited length, each resumed from what is already
# measured, and pack what they filled into $OUT for the machine to send back. The same command, with the steps not
# yet done, continues on the next call (a warm machine resumes from its work folder, a fresh one from the results
# unpacked into the tree). A step is not started with less than MIN_S seconds left: it would spend them loading.
#
#   scripts/gpu/steps.sh CAMPAIGN SECONDS STEP [STEP ...]      (repo root, on the GPU machine, .whl carried)
#   then here: tar -xzf <files_at>/results.tgz               (at the repo root)
set -uo pipefail
campaign=$1 seconds=$2
shift 2
source scripts/gpu/env.sh
set +e
deadline=$(($(date +%s) + seconds))
min_s=${MIN_S:-150}
results=$(python3 -c "from dsexp.campaign.spec import load; print(load('$campaign').results)")
for step in "$@"; do
    if [[ -e /tmp/steps-done/$step ]]; then echo "# $step: done earlier on this machine"; continue; fi
    left=$((deadline - $(date +%s)))
    if ((left < min_s)); then echo "# $step: not started, ${left} s left"; break; fi
    echo "# $step: started with ${left} s left ($(date -u +%T))"
    timeout --kill-after=60 "$left" python3 -m dsexp.campaign "$campaign" --only "$step" --resume 2>&1 | tee -a "$OUT/log.txt"
    rc=${PIPESTATUS[0]}
    echo "# $step: exit $rc ($(date -u +%T))" | tee -a "$OUT/log.txt"
    # 130 / 124: stopped by the deadline, its measurements copied; the next call resumes it
    if ((rc == 130 || rc == 124 || rc == 137)); then break; fi
    mkdir -p /tmp/steps-done && touch "/tmp/steps-done/$step"
done
ls -d "$results/campaign.json" "${@/#/$results/}" 2>/dev/null | xargs tar -czf "$OUT/results.tgz"
tar -tzf "$OUT/results.tgz" | awk -F/ '{print $1"/"$2"/"$3"/"$4}' | sort | uniq -c
