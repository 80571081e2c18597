/*
 * A QEMU TCG plugin that counts the guest instructions a program executes, for comparing
 * kernel sets under emulation (tools/arm64/insns-per-token): real ARM speed cannot be measured
 * on an x86 machine, but the instructions each kernel set executes can.
 *
 * Load with: qemu-aarch64 -plugin libinsns.so,out=FILE PROGRAM...
 * On exit FILE holds "insns N". Each translated block adds its instruction count to one
 * atomic counter every time it runs (the engine's pool threads all count).
 *
 * QEMU's plugin header is not packaged by Debian, so the few declarations used are written
 * out below: they are QEMU's stable plugin C ABI (API version 1, QEMU 4.2 to 8.x).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
typedef struct qemu_info_t qemu_info_t;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS };

typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);

void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

static uint64_t insns;
static char out_path[4096];

static void on_exec(unsigned int vcpu, void *n) {
    (void)vcpu;
    __atomic_fetch_add(&insns, (uint64_t)(uintptr_t)n, __ATOMIC_RELAXED);
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_cb(tb, on_exec, QEMU_PLUGIN_CB_NO_REGS,
                                         (void *)(uintptr_t)qemu_plugin_tb_n_insns(tb));
}

static void on_atexit(qemu_plugin_id_t id, void *p) {
    (void)id;
    (void)p;
    FILE *f = fopen(out_path, "w");
    if (!f) {
        fprintf(stderr, "insns plugin: cannot write %s\n", out_path);
        return;
    }
    fprintf(f, "insns %llu\n", (unsigned long long)__atomic_load_n(&insns, __ATOMIC_RELAXED));
    fclose(f);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                                               int argc, char **argv) {
    (void)info;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0 && strlen(argv[i] + 4) < sizeof out_path) {
            strcpy(out_path, argv[i] + 4);
        }
    }
    if (!out_path[0]) {
        fprintf(stderr, "insns plugin: give out=FILE\n");
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_atexit, NULL);
    return 0;
}
