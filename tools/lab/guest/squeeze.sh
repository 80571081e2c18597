# The squeeze (docs/lab.md): 8 apps hold conversations and call at a trace's times while a
# pressure process takes memory in a ramp, holds it near the limit, and gives it back. Run
# once per system: llmsd (budget following pressure), fixed-budget (llmsd, pressure-following
# off), status-quo (an engine per app, the kernel swapping to zram, a PSI killer ending apps).
# Args: SYSTEM [HOG_PLAN [NAME]] (NAME: the scenario's name in the results). Results: /out/result.json, /out/timeline.jsonl, logs.
# A scenario that sources this one may set BUDGET, TRACE, DRIVE_FLAGS and TOML (llmsd.toml lines).
set -u
SYSTEM=$1
PLAN=${2:-0:0,15:40%,20:55%,25:65%,30:75%,90:75%,100:0}
NAME=${3:-squeeze}
BUDGET=${BUDGET:-64MiB}
TRACE=${TRACE:-/lab/trace.jsonl}
DRIVE_FLAGS=${DRIVE_FLAGS:-}
TOML=${TOML:-}
A=/sys/fs/cgroup/apps
P=/sys/fs/cgroup/pressure
mkdir -p $A $P
export LLMS_SOCKET=/run/llmsd.sock
case $SYSTEM in
    llmsd|fixed-budget)
        FLAGS=""
        [ $SYSTEM = fixed-budget ] && FLAGS=--no-pressure
        # No load profile (measuring it takes minutes under TCG): loads read every record.
        printf 'load_profile = false\n%s\n' "$TOML" > /run/llmsd.toml
        sh -c "echo \$\$ > $A/cgroup.procs; echo -900 > /proc/self/oom_score_adj; exec llmsd --config /run/llmsd.toml --model /lab/model.gguf --state-dir /store/state --budget $BUDGET --threads 2 $FLAGS" \
            > /out/llmsd.log 2>&1 &
        LLMSD=$!
        i=0; while [ ! -S $LLMS_SOCKET ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
        [ -S $LLMS_SOCKET ] || { echo "llmsd did not start"; cat /out/llmsd.log; exit 1; }
        ;;
    status-quo) LLMSD="" ;;
    *) echo "system $SYSTEM: llmsd, fixed-budget or status-quo"; exit 2 ;;
esac
# The killer watches every system's apps group (llmsd, a system service at adj -900, is not a
# candidate, as lmkd never kills negative adj); it and the driver stay out of both groups.
llms lab killer --cgroup $A --out /out/kills.jsonl > /out/killer.log 2>&1 &
KILLER=$!
sh -c "echo \$\$ > $P/cgroup.procs; exec llms lab hog --plan $PLAN --touch-ms 2000 --out /out/hog.jsonl" > /out/hog.log 2>&1 &
HOG=$!
llms lab drive --system $SYSTEM --scenario $NAME --trace $TRACE --out /out --model /lab/model.gguf $DRIVE_FLAGS \
    --apps-cgroup $A --pressure-cgroup $P --killer-log /out/kills.jsonl --hog-log /out/hog.jsonl --max-seconds 150
RC=$?
wait $HOG
kill $KILLER
[ -n "$LLMSD" ] && { kill $LLMSD; wait $LLMSD; }
cat $A/memory.events > /out/apps.memory.events
cat $P/memory.events > /out/pressure.memory.events
exit $RC
