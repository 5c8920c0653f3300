/* AMX tiles as both of their users take them (qgemm.c's bf16 products, q8_amx.c's integer
   ones): the tile configuration's layout (palette 1) and Linux's grant of the tile state,
   asked for once per process (a library built with AMX's instructions may still be
   refused it: a kernel too old, or a sandbox). */
#ifndef GT_AMX_TILES_H
#define GT_AMX_TILES_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gt_tilecfg;

/* whether this process may use the tiles */
static inline int gt_amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}
#endif
