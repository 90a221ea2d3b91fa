/* An AVX2-only view of this CPU for one process tree, at native speed: loaded with LD_PRELOAD, it makes the
 * CPUID instruction fault (Linux's ARCH_SET_CPUID, on CPUs with CPUID faulting), answers each faulting
 * CPUID itself with the real values less AVX-512, AVX-VNNI and AMX, and steps over it. onnxruntime, numpy and
 * anything else that picks its kernels from CPUID then takes its AVX2 paths, as on an AVX2-only machine.
 * The mask is reset by execve; LD_PRELOAD in the environment sets it again in every child process.
 *
 *     cc -O2 -shared -fPIC -o mask_cpuid.so mask_cpuid.c
 *     LD_PRELOAD=$PWD/mask_cpuid.so python -m pytest -p no:faulthandler ...
 *
 * Python's faulthandler must stay off: it would take SIGSEGV before this handler.
 * Where CPUID faulting is unavailable the library does nothing (the CPU view is the real one).
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define BIT(n) (1u << (n))

/* Leaf 7, subleaf 0: EBX AVX512F DQ IFMA PF ER CD BW VL; ECX AVX512_VBMI VBMI2 VNNI BITALG VPOPCNTDQ;
 * EDX AVX512_4VNNIW 4FMAPS VP2INTERSECT AMX-BF16 AVX512_FP16 AMX-TILE AMX-INT8. */
static const unsigned LEAF7_EBX = BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
static const unsigned LEAF7_ECX = BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14);
static const unsigned LEAF7_EDX = BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25);
/* Leaf 7, subleaf 1: EAX AVX-VNNI AVX512_BF16 AVX-IFMA; EDX AVX-VNNI-INT8 AVX-NE-CONVERT AVX-VNNI-INT16. */
static const unsigned LEAF7_1_EAX = BIT(4) | BIT(5) | BIT(23);
static const unsigned LEAF7_1_EDX = BIT(4) | BIT(5) | BIT(10);

static long cpuid_faults(int on) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void on_fault(int sig, siginfo_t *info, void *context) {
    (void)info;
    greg_t *reg = ((ucontext_t *)context)->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)reg[REG_RIP];
    if (ip[0] != 0x0f || ip[1] != 0xa2) { /* a real fault, not CPUID: let it end the process as it would */
        signal(sig, SIG_DFL);
        return;
    }
    unsigned leaf = (unsigned)reg[REG_RAX], subleaf = (unsigned)reg[REG_RCX], a, b, c, d;
    cpuid_faults(0);
    __cpuid_count(leaf, subleaf, a, b, c, d);
    cpuid_faults(1);
    if (leaf == 7 && subleaf == 0) {
        b &= ~LEAF7_EBX;
        c &= ~LEAF7_ECX;
        d &= ~LEAF7_EDX;
    } else if (leaf == 7 && subleaf == 1) {
        a &= ~LEAF7_1_EAX;
        d &= ~LEAF7_1_EDX;
    }
    reg[REG_RAX] = a;
    reg[REG_RBX] = b;
    reg[REG_RCX] = c;
    reg[REG_RDX] = d;
    reg[REG_RIP] += 2;
}

__attribute__((constructor)) static void mask_cpuid(void) {
    struct sigaction action = {0};
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, 0) == 0)
        cpuid_faults(1);
}
