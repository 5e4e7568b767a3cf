/*
 * glibc_compat.h: pin the glibc symbol versions the hook links against (force-included
 * into every source by build.py).
 *
 * Built on a new glibc, a library that calls dlsym/dlopen/pthread_once... records the
 * GLIBC_2.34 versions (libdl and libpthread were merged into libc there) and then refuses
 * to load on CUDA 11 images (glibc 2.31). Each symbol below is bound to the version it had
 * in the architecture's first glibc instead; tests/hook/test_build.py checks
 * that nothing newer than 2.17 is required.
 */
#ifndef GEMINI_GLIBC_COMPAT_H
#define GEMINI_GLIBC_COMPAT_H

#if defined(__x86_64__)
#define GM_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define GM_GLIBC_BASE "GLIBC_2.17"
#else
#error "gemini hook: add the base glibc version of this architecture"
#endif

#define GM_OLD_SYMBOL(sym) __asm__(".symver " #sym "," #sym "@" GM_GLIBC_BASE);

GM_OLD_SYMBOL(dlopen)
GM_OLD_SYMBOL(dlclose)
GM_OLD_SYMBOL(dlvsym)
GM_OLD_SYMBOL(dladdr)
GM_OLD_SYMBOL(dlerror)
GM_OLD_SYMBOL(pthread_once)
GM_OLD_SYMBOL(pthread_atfork)
GM_OLD_SYMBOL(pthread_mutex_trylock)

#endif
