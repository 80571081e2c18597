# Paged weights against the kernel's own answer (#58, docs/lab.md "weights"): the same packed
# weight image, decoded (1) paged by mm from /store with a budget of a share of the weight bytes
# and (2) mapped from its file and paged by the page cache, in a group whose memory.max leaves
# the same room: the most anonymous memory run (1) held (its budget included). Bytes read from
# the disk are the guest's block statistics for /dev/vda (sectors read), per token decoded: the
# difference between a run of LONG and one of SHORT tokens, so loading and prefill cancel.
# Results: /out/weights.jsonl (one line per run), /out/weights-*.txt (each run's output).
# Usage: weights.sh [SHARE% [SHORT LONG]] (4 and 12 by default: each token decodes twice per run,
# at under a token per second under TCG when paged; make lab has 20 minutes for everything).
set -u
SHARE=${1:-50%}
SHORT=${2:-4}
LONG=${3:-12}
mkdir -p /store/w
M=/store/w/model.gguf
IMG=/store/w/model.llms-weights
cp /lab/weights.gguf $M
# The image, built once (timed runs must not build it), then everything on flash only.
llms bench --model $M --weights paged --weights-image $IMG --pp 1 --tg 1 --reps 1 > /out/weights-build.txt 2>&1 || {
    cat /out/weights-build.txt; exit 1; }
sectors() { awk '{print $3}' /sys/block/vda/stat; }

# run NAME TOKENS MEMORY_MAX ARGS...: one decode in its own group, cold caches; prints its line.
run() {
    local name=$1 tokens=$2 max=$3; shift 3
    local g=/sys/fs/cgroup/w-$name-$tokens
    mkdir -p $g
    echo "$max" > $g/memory.max
    sync; echo 3 > /proc/sys/vm/drop_caches
    local r0 anon=0 a pid
    r0=$(sectors)
    sh -c "echo \$\$ > $g/cgroup.procs; exec llms bench --model $M --weights-image $IMG --pp 1 --tg $tokens --reps 1 --threads 2 $*" \
        > /out/weights-$name-$tokens.txt 2>&1 &
    pid=$!
    # The group's anonymous memory, at its highest (memory.peak counts the page cache too).
    while kill -0 $pid 2>/dev/null; do
        a=$(awk '$1 == "anon" {print $2}' $g/memory.stat)
        [ "${a:-0}" -gt $anon ] && anon=$a
        sleep 0.1
    done
    wait $pid || { cat /out/weights-$name-$tokens.txt; return 1; }
    local tg
    tg=$(sed -n "s/.*tg$tokens: \([0-9.]*\) tok\/s.*/\1/p" /out/weights-$name-$tokens.txt)
    printf '{"run":"%s","tokens":%s,"memory_max":"%s","read_bytes":%s,"anon_peak":%s,"tg_tok_s":%s,"file_peak":%s}\n' \
        "$name" "$tokens" "$max" $((($(sectors) - r0) * 512)) "$anon" "${tg:-0}" \
        "$(awk '$1 == "file" {print $2}' $g/memory.stat)" | tee -a /out/weights.jsonl
    rmdir $g 2>/dev/null || true
}

: > /out/weights.jsonl
run paged $SHORT max --weights paged --weights-budget $SHARE || exit 1
run paged $LONG max --weights paged --weights-budget $SHARE || exit 1
# The room run (1) held at most; the mapped run gets that much.
ROOM=$(sed -n 's/.*"anon_peak":\([0-9]*\).*/\1/p' /out/weights.jsonl | sort -n | tail -1)
run mmap $SHORT $ROOM --weights mmap || exit 1
run mmap $LONG $ROOM --weights mmap || exit 1
# And the mapped image with no limit (everything stays cached after its first read).
run mmap-unlimited $SHORT max --weights mmap || exit 1
run mmap-unlimited $LONG max --weights mmap || exit 1
echo "weights: done"
