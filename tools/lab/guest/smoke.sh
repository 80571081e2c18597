# The lab's smoke run (make test, tools/tests/lab.rs): llmsd in a cgroup v2 group with
# memory.high, two contexts with KV resident, one pressure step in the same group (a file on a
# tmpfs: shmem is charged to the writer's group and swaps to zram), then the monitor has to
# see the group's real PSI and llmsd's budget has to shrink; the step ends and the budget has to
# come back. Every wait is bounded. Results: /out/*.json, /out/llmsd.log, /out/smoke.env.
set -u
G=/sys/fs/cgroup/llmsd
HIGH_MB=${1:-96}
STEP_MB=${2:-128}
mkdir -p $G
echo $((HIGH_MB << 20)) > $G/memory.high
export LLMS_SOCKET=/run/llmsd.sock
# No load profile: measuring it takes minutes under TCG, and the smoke plans no switch.
echo 'load_profile = false' > /run/llmsd.toml
# llmsd enters the group before it starts (its monitor finds the group from /proc/self/cgroup).
sh -c "echo \$\$ > $G/cgroup.procs; exec llmsd --config /run/llmsd.toml --model /lab/model.gguf --state-dir /store/state --budget 32MiB --threads 2" \
    > /out/llmsd.log 2>&1 &
LLMSD=$!
i=0; while [ ! -S $LLMS_SOCKET ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
[ -S $LLMS_SOCKET ] || { echo "llmsd did not start"; exit 1; }

# The monitor's samples and events, as llmsd's own monitor sees the group (for the record).
llms pressure watch --json --cgroup $G --interval-ms 250 --budget-max $((32 << 20)) > /out/pressure.jsonl 2>&1 &
WATCH=$!
# Two contexts holding KV (the second takes the first's whole chunks: same app, same text).
TEXT=$(for k in $(seq 1 16); do printf 'The quick brown fox jumps over the lazy dog near the river bank %s. ' $k; done)
for c in 1 2; do
    id=$(llms ctx new) || exit 1
    llms ctx call --raw --max-tokens 4 --json "$id" "$TEXT" > /out/call$c.json || exit 1
done
llms stats --json > /out/stats-before.json
cat $G/memory.pressure > /out/psi-before
cat $G/memory.events > /out/events-before

# The pressure step: STEP_MB into a tmpfs file from inside the group (more than memory.high).
mkdir -p /hog && mount -t tmpfs -o size=$((STEP_MB + 16))m hog /hog
sh -c "echo \$\$ > $G/cgroup.procs; exec dd if=/dev/zero of=/hog/f bs=1M count=$STEP_MB" 2>/dev/null &
HOG=$!
# Wait (bounded) for llmsd's budget to drop below its configured value.
shrunk=0; i=0
while [ $i -lt 60 ]; do
    llms stats --json > /out/stats-during.json 2>/dev/null
    if grep -q '"budget_bytes":' /out/stats-during.json; then
        b=$(sed -n 's/.*"budget_bytes":\([0-9]*\).*/\1/p' /out/stats-during.json)
        c=$(sed -n 's/.*"configured_budget_bytes":\([0-9]*\).*/\1/p' /out/stats-during.json)
        if [ "$b" -lt "$c" ]; then shrunk=1; break; fi
    fi
    sleep 0.5; i=$((i + 1))
done
wait $HOG
cat $G/memory.pressure > /out/psi-during
cat $G/memory.events > /out/events-during
# The step ends: the file goes, the budget should grow back.
rm -f /hog/f; umount /hog
grown=0; i=0
while [ $shrunk = 1 ] && [ $i -lt 60 ]; do
    llms stats --json > /out/stats-after.json 2>/dev/null
    b=$(sed -n 's/.*"budget_bytes":\([0-9]*\).*/\1/p' /out/stats-after.json)
    c=$(sed -n 's/.*"configured_budget_bytes":\([0-9]*\).*/\1/p' /out/stats-after.json)
    if [ -n "$b" ] && [ "$b" -ge "$c" ]; then grown=1; break; fi
    sleep 0.5; i=$((i + 1))
done
alive=0; kill -0 $LLMSD 2>/dev/null && alive=1
kill $LLMSD $WATCH; wait $LLMSD
printf 'shrunk=%s\ngrown=%s\nalive=%s\nhigh_mb=%s\nstep_mb=%s\n' $shrunk $grown $alive $HIGH_MB $STEP_MB > /out/smoke.env
cat /out/smoke.env
