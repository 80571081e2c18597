#!/usr/bin/env bash
# The device lab (docs/lab.md): a real Linux kernel under qemu, booted from an initramfs of our
# own, with cgroup v2, zram swap and a virtio disk for llmsd's store; a scenario runs inside and
# its results come back as a tar stream on a second virtio disk (no network, no 9p, no mount or
# loop device on the host).
#
#   tools/lab/lab.sh deps                 qemu-system-x86 (installed when missing), the guest
#                                         kernel and busybox-static (downloaded, not installed)
#   tools/lab/lab.sh run SCENARIO [ARGS]  boots a guest that runs tools/lab/guest/SCENARIO.sh
#                                         ARGS; results in $LAB_OUT (target/lab/out/SCENARIO)
#
# Environment: LLMS_BIN, LLMSD_BIN (the binaries put in the guest; default target/release),
# LAB_MEM (guest memory, default 1G), LAB_CPUS (2), LAB_TIMEOUT (seconds, default 600: the guest
# is killed after it), LAB_ACCEL (kvm or tcg; default: kvm when a probe boot works, else tcg),
# LAB_OUT (where results go).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LAB="$ROOT/target/lab"
CACHE="$LAB/cache"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)

die() { echo "lab: $*" >&2; exit 1; }

# Debian's packages: qemu is installed (it is a program the host runs); the kernel and busybox
# are only downloaded and unpacked under target/lab/cache (they run in the guest).
deps() {
    if ! command -v qemu-system-x86_64 >/dev/null; then
        echo "lab: installing qemu-system-x86 (Debian's package)"
        $SUDO apt-get install -y --no-install-recommends qemu-system-x86 ||
            { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends qemu-system-x86; }
    fi
    mkdir -p "$CACHE"
    if [ ! -s "$CACHE/kernel.ok" ]; then
        # The newest 6.12 cloud kernel of Debian's archive (bookworm's own 6.1 lacks
        # userfaultfd MOVE, POISON and WP_ASYNC); its version is recorded in every result.
        local pkg
        pkg=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -1)
        if [ -z "$pkg" ]; then
            $SUDO apt-get update >/dev/null
            pkg=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -1)
        fi
        [ -n "$pkg" ] || die "no linux-image-6.12.*-cloud-amd64-unsigned in the package archive"
        rm -rf "$CACHE/debs" "$CACHE/x" && mkdir -p "$CACHE/debs" "$CACHE/x"
        # apt-get download writes as _apt when it can: a directory of its own it may write.
        chmod 0777 "$CACHE/debs"
        (cd "$CACHE/debs" && apt-get download "$pkg" busybox-static >/dev/null 2>&1) ||
            die "apt-get download $pkg busybox-static failed"
        for d in "$CACHE"/debs/*.deb; do dpkg-deb -x "$d" "$CACHE/x"; done
        rm -rf "$CACHE/debs"
        echo "$pkg" > "$CACHE/kernel.ok"
    fi
}

kernel_image() { ls "$CACHE"/x/boot/vmlinuz-* | head -1; }
kernel_release() { basename "$(kernel_image)" | sed 's/^vmlinuz-//'; }

# Copies a kernel module and what it depends on (its .modinfo `depends=`), decompressed: busybox
# insmod reads plain .ko files. Appends to $MODS the load order.
MODS=""
add_module() {
    local name=$1 kdir f deps d
    case " $MODS " in *" $name "*) return;; esac
    kdir="$CACHE/x/lib/modules/$(kernel_release)/kernel"
    f=$(find "$kdir" -name "$name.ko.xz" -o -name "$(echo "$name" | tr _ -).ko.xz" | head -1)
    [ -n "$f" ] || die "kernel module $name not found in $(kernel_release)"
    deps=$(xz -dc "$f" | strings | sed -n 's/^depends=//p' | head -1 | tr , ' ')
    for d in $deps; do add_module "$d"; done
    mkdir -p "$STAGE/lib/modules"
    xz -dc "$f" > "$STAGE/lib/modules/$name.ko"
    MODS="$MODS $name"
}

# Copies a dynamically linked program and the libraries it loads to the same paths.
add_program() {
    local src=$1 dst=$2 lib
    install -D -m 0755 "$src" "$STAGE$dst"
    # Without debug info: the initramfs lives in the guest's memory.
    strip "$STAGE$dst" 2>/dev/null || true
    for lib in $(ldd "$src" | awk '/=>/ {print $3} /^[ \t]*\/lib/ {print $1}'); do
        [ -e "$STAGE$lib" ] || install -D -m 0755 "$lib" "$STAGE$lib"
    done
}

# The initramfs: busybox, the modules, llms and llmsd, the model, the guest scripts.
initramfs() {
    STAGE="$LAB/stage"
    rm -rf "$STAGE" && mkdir -p "$STAGE"/{bin,dev,proc,sys,run,tmp,lab,store,out}
    cp "$CACHE/x/bin/busybox" "$STAGE/bin/busybox"
    for m in virtio_blk zram; do add_module "$m"; done
    echo "$MODS" > "$STAGE/lab/modules"
    add_program "${LLMS_BIN:-$ROOT/target/release/llms}" /bin/llms
    add_program "${LLMSD_BIN:-$ROOT/target/release/llmsd}" /bin/llmsd
    cp "$LAB/model.gguf" "$STAGE/lab/model.gguf"
    [ "$SCENARIO" != weights ] || cp "$LAB/weights.gguf" "$STAGE/lab/weights.gguf"
    cp "$LAB/trace.jsonl" "$STAGE/lab/trace.jsonl"
    [ "$SCENARIO" != held ] || cp "$LAB/trace-held.jsonl" "$STAGE/lab/trace-held.jsonl"
    cp "$HERE"/guest/*.sh "$STAGE/lab/"
    echo "${LAB_ARGS:-}" > "$STAGE/lab/args"
    install -m 0755 "$HERE/guest/init" "$STAGE/init"
    (cd "$STAGE" && find . | "$CACHE/x/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 > "$LAB/initrd.gz")
    rm -rf "$STAGE"
}

# The guest's model: random weights of a small shape (docs/lab.md: TCG runs the engine 50-80x
# slower than the host; the point is the memory dynamics). Made once by `llms synth`.
model() {
    [ -s "$LAB/model.gguf" ] && return
    # Few, wide layers: under TCG each operation has a high fixed cost (a 128-wide 16-layer
    # shape with twice the KV per token prefilled at 14 tok/s against this one's 34).
    "${LLMS_BIN:-$ROOT/target/release/llms}" synth --dim 256 --layers 4 --heads 4 --kv-heads 4 --ffn 512 \
        --type q8_0 --out "$LAB/model.gguf.tmp" >/dev/null
    mv "$LAB/model.gguf.tmp" "$LAB/model.gguf"
}

# The weights scenario's model: larger, so that half its weights is well above what the
# process's own memory varies by (~54 MB of weights: 8 layers of 512, Q8_0).
weights_model() {
    [ -s "$LAB/weights.gguf" ] && return
    "${LLMS_BIN:-$ROOT/target/release/llms}" synth --dim 512 --layers 8 --heads 8 --kv-heads 8 --ffn 2048 \
        --type q8_0 --out "$LAB/weights.gguf.tmp" >/dev/null
    mv "$LAB/weights.gguf.tmp" "$LAB/weights.gguf"
}

# The apps' trace (docs/traces.md): 8 apps with a context each, Table 3's tasks at a fifth of
# their lengths, Markov switching, Poisson arrivals; seeded, made on the host (the guest has no
# corpus).
trace() {
    [ -s "$LAB/trace.jsonl" ] && return
    "${LLMS_BIN:-$ROOT/target/release/llms}" trace gen --out "$LAB/trace.jsonl.tmp" --contexts 8 --apps 8 --calls 48 \
        --rate 0.4 --seed 1 --scale 0.2 >/dev/null
    mv "$LAB/trace.jsonl.tmp" "$LAB/trace.jsonl"
}

# The held scenario's trace and state (tools/lab/guest/held.sh): short calls (Table 3's deltas
# at a fiftieth) over 8 contexts that each already hold a conversation of LAB_HELD_TOKENS tokens,
# built here by llmsd itself (`llms lab prebuild`) and put on the guest's flash.
trace_held() {
    [ -s "$LAB/trace-held.jsonl" ] && return
    "${LLMS_BIN:-$ROOT/target/release/llms}" trace gen --out "$LAB/trace-held.jsonl.tmp" --contexts 8 --apps 8 --calls 60 \
        --rate 0.4 --seed 2 --scale 0.02 >/dev/null
    mv "$LAB/trace-held.jsonl.tmp" "$LAB/trace-held.jsonl"
}

held_state() {
    # Made again when the model is newer (its records and contexts are the model's).
    [ -d "$LAB/held/state" ] && [ "$LAB/held/state" -nt "$LAB/model.gguf" ] && return
    rm -rf "$LAB/held.tmp"
    "${LLMS_BIN:-$ROOT/target/release/llms}" lab prebuild --trace "$LAB/trace-held.jsonl" --model "$LAB/model.gguf" \
        --state-dir "$LAB/held.tmp/state" --tokens "${LAB_HELD_TOKENS:-7168}" --max-context-tokens 8192 >/dev/null
    rm -f "$LAB/held.tmp/state/llmsd.lock"
    mv "$LAB/held.tmp" "$LAB/held"
}

qemu_cmd() {
    local accel=$1
    echo qemu-system-x86_64 -accel "$accel" -cpu max -smp "${LAB_CPUS:-2}" -m "${LAB_MEM:-1G}" \
        -nographic -no-reboot -nodefaults -serial stdio -kernel "$(kernel_image)" -initrd "$LAB/initrd.gz"
}

# KVM only where a probe boot reaches userspace (on these machines every vCPU stops with
# "KVM internal error"); TCG otherwise.
accel() {
    if [ -n "${LAB_ACCEL:-}" ]; then echo "$LAB_ACCEL"; return; fi
    if [ -r /dev/kvm ] && [ -w /dev/kvm ] &&
        timeout -k 2 20 $(qemu_cmd kvm) -append "console=ttyS0 quiet panic=-1 lab.scenario=probe" 2>/dev/null | grep -q LAB-PROBE-OK; then
        echo kvm
    else
        echo tcg,thread=multi
    fi
}

run() {
    local scenario=$1; shift
    [ -f "$HERE/guest/$scenario.sh" ] || die "no scenario $scenario (tools/lab/guest/$scenario.sh)"
    deps
    model
    trace
    SCENARIO=$scenario
    [ "$scenario" != weights ] || weights_model
    if [ "$scenario" = held ]; then trace_held; held_state; fi
    # The scenario's arguments, quoted for the guest's shell.
    LAB_ARGS=""
    [ $# -eq 0 ] || LAB_ARGS=$(printf '%q ' "$@")
    initramfs
    local out="${LAB_OUT:-$LAB/out/$scenario}" acc rc=0
    rm -rf "$out" && mkdir -p "$out"
    DISKS=$(mktemp -d "$LAB/disks.XXXXXX")
    trap 'rm -rf "$DISKS"' EXIT INT TERM
    local disks=$DISKS
    # vda: llmsd's flash (the guest formats it); vdb: the results, a tar stream the guest writes.
    truncate -s "${LAB_STORE:-2G}" "$disks/store.img"
    # ext4 made here (busybox's mke2fs makes ext2 only); mkfs writes a plain file, no loop device.
    # (held: with the conversations built on the host in it, as /store/state.)
    local from=()
    [ "$scenario" != held ] || from=(-d "$LAB/held")
    mkfs.ext4 -q -F -E lazy_itable_init=1 "${from[@]}" "$disks/store.img"
    truncate -s 256M "$disks/out.img"
    acc=$(accel)
    echo "lab: booting $(kernel_release) ($acc, ${LAB_MEM:-1G}, ${LAB_CPUS:-2} vCPUs): $scenario $*"
    # Under multi-threaded TCG the kernel has been seen to oops while patching its own text at
    # boot (int3 in sched_clock_cpu, 3 s in, once in ~20 boots): a boot that panics before the
    # scenario starts is retried, twice at most; a panic after it started is a result.
    local try
    for try in 1 2 3; do
        rc=0
        timeout -k 5 "${LAB_TIMEOUT:-600}" $(qemu_cmd "$acc") \
            -drive "file=$disks/store.img,format=raw,if=virtio,cache=unsafe" \
            -drive "file=$disks/out.img,format=raw,if=virtio" \
            -append "console=ttyS0 quiet panic=-1 lab.scenario=$scenario" \
            > "$out/console.log" 2>&1 </dev/null || rc=$?
        grep -q "lab: $scenario" "$out/console.log" || ! grep -q "Kernel panic" "$out/console.log" && break
        echo "lab: the guest's kernel panicked while booting (try $try); booting again" >&2
        cp "$out/console.log" "$out/console.panic$try.log"
    done
    tar -xf "$disks/out.img" -C "$out" 2>/dev/null || true
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        tail -20 "$out/console.log" >&2
        die "the guest did not finish within ${LAB_TIMEOUT:-600} s (killed)"
    fi
    [ -f "$out/done" ] || { tail -30 "$out/console.log" >&2; die "the guest ended without results (qemu exit $rc)"; }
    echo "lab: results in $out"
}

cmd=${1:-}
shift || true
case "$cmd" in
    deps) deps ;;
    run) [ $# -ge 1 ] || die "usage: lab.sh run SCENARIO [ARGS]"; run "$@" ;;
    *) die "usage: lab.sh deps | run SCENARIO [ARGS]" ;;
esac
