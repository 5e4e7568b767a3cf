/*
 * images.c: how much device memory a module image's global variables take, read from the
 * image itself, before the driver loads it (so a module far past the limit is refused before
 * the driver reserves anything). The driver's call is measured as well
 * (modules.c); this reading is the part no measurement noise can hide.
 *
 * - PTX text: every module-scope `.global` declaration (not `.extern`): element size x vector
 *   width x array dimensions.
 * - ELF cubin (64-bit): the objects of the sections `.nv.global*` (their symbols' sizes:
 *   ptxas leaves the section itself empty) and common objects.
 * - fatbin (magic 0xBA55ED50, or the runtime's wrapper 0x466243b1 around one): each entry's
 *   PTX or ELF as above. A compressed entry (its packed size at offset 16 of the entry's header,
 *   its size unpacked at 56) is unpacked first: LZ4 (flag 0x2000, nvcc's default; lz4.c) or
 *   zstd (flag 0x8000, nvcc's --compress-mode=size; zstd.c, where libzstd loads).
 * Anything not read whole (a zstd entry without libzstd, an unsized array, another format)
 * clears *understood: the caller then trusts the measurement alone, uncapped.
 */
#include <string.h>
#include <sys/mman.h>

#include "memory.h"

#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243b1u
#define FATBIN_KIND_PTX 1
#define FATBIN_KIND_ELF 2
#define FATBIN_FLAG_LZ4 0x2000ull
#define FATBIN_FLAG_ZSTD 0x8000ull
#define MAX_UNPACKED (256ull << 20)   /* an entry larger unpacked is measured, not read */
#define MAX_IMAGE (1ull << 40)   /* sizes past this are not an image's */

static uint64_t add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
static uint64_t mul(uint64_t a, uint64_t b) {
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

static uint16_t u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ---- PTX ---- */

struct cursor {
    const char *p, *end;
    int braces, parens;
};

/* Skips blanks and comments; 0 at the end. */
static int skip_space(struct cursor *c) {
    while (c->p < c->end) {
        if (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r') {
            c->p++;
        } else if (c->p + 1 < c->end && c->p[0] == '/' && c->p[1] == '/') {
            while (c->p < c->end && *c->p != '\n') c->p++;
        } else if (c->p + 1 < c->end && c->p[0] == '/' && c->p[1] == '*') {
            const char *close = NULL;
            for (const char *q = c->p + 2; q + 1 < c->end; q++)
                if (q[0] == '*' && q[1] == '/') { close = q + 2; break; }
            c->p = close ? close : c->end;
        } else {
            return 1;
        }
    }
    return 0;
}

static int word_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_' || ch == '$' || ch == '%' || ch == '.';
}

/* The next token: a word (directives, names, numbers) or one punctuation character. */
static size_t token(struct cursor *c, const char **start) {
    if (!skip_space(c)) return 0;
    *start = c->p;
    if (word_char(*c->p)) {
        while (c->p < c->end && word_char(*c->p)) c->p++;
    } else {
        c->p++;
    }
    return (size_t)(c->p - *start);
}

static int is(const char *t, size_t n, const char *word) {
    return strlen(word) == n && memcmp(t, word, n) == 0;
}

static uint64_t type_bytes(const char *t, size_t n) {
    if (n < 3 || t[0] != '.') return 0;
    char kind = t[1];
    if (kind != 'b' && kind != 'u' && kind != 's' && kind != 'f' && kind != 'e') {
        if (is(t, n, ".bf16")) return 2;
        if (is(t, n, ".bf16x2")) return 4;
        return 0;
    }
    if (is(t, n, ".f16x2")) return 4;
    uint64_t bits = 0;
    for (size_t i = 2; i < n; i++) {
        if (t[i] < '0' || t[i] > '9') return 0;
        bits = bits * 10 + (uint64_t)(t[i] - '0');
    }
    return bits >= 8 ? bits / 8 : 0;
}

static uint64_t number(const char *t, size_t n, int *ok) {
    uint64_t v = 0;
    *ok = n > 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i] < '0' || t[i] > '9') { *ok = 0; return 0; }
        v = add(mul(v, 10), (uint64_t)(t[i] - '0'));
    }
    return v;
}

/* One `.global ...;` statement, the cursor just past `.global`. */
static uint64_t ptx_declaration(struct cursor *c, int *understood) {
    uint64_t element = 0, vector = 1, total = 0;
    const char *t;
    size_t n;
    /* The directives before the first name. */
    for (;;) {
        const char *save = c->p;
        n = token(c, &t);
        if (n == 0) return total;
        if (t[0] != '.') { c->p = save; break; }
        if (is(t, n, ".align")) { token(c, &t); continue; }
        if (is(t, n, ".v2")) { vector = 2; continue; }
        if (is(t, n, ".v4")) { vector = 4; continue; }
        if (is(t, n, ".v8")) { vector = 8; continue; }
        uint64_t bytes = type_bytes(t, n);
        if (bytes) element = bytes;
    }
    if (element == 0) *understood = 0;
    /* name [dims]... [= initialiser] {, name ...} ; */
    for (;;) {
        n = token(c, &t);
        if (n == 0 || t[0] == ';') return total;
        uint64_t count = 1;
        for (;;) {
            const char *save = c->p;
            n = token(c, &t);
            if (n == 0) return total;
            if (t[0] != '[') { c->p = save; break; }
            n = token(c, &t);
            int ok = 0;
            uint64_t dim = n ? number(t, n, &ok) : 0;
            if (ok) {
                count = mul(count, dim);
                token(c, &t);   /* ] */
            } else {
                *understood = 0;   /* unsized: the initialiser sizes it */
                if (!(n == 1 && t[0] == ']'))
                    while (token(c, &t) && t[0] != ']') {}
            }
        }
        total = add(total, mul(mul(element, vector), count));
        /* To the next name or the end of the statement, past any initialiser. */
        int depth = 0;
        for (;;) {
            n = token(c, &t);
            if (n == 0) return total;
            if (t[0] == '{') depth++;
            else if (t[0] == '}') depth--;
            else if (depth <= 0 && t[0] == ';') return total;
            else if (depth <= 0 && t[0] == ',') break;
        }
    }
}

static uint64_t ptx_globals(const char *text, size_t size, int *understood) {
    struct cursor c = {text, text + size, 0, 0};
    uint64_t total = 0;
    int external = 0;   /* the statement so far says .extern */
    const char *t;
    size_t n;
    while ((n = token(&c, &t)) != 0) {
        switch (t[0]) {
        case '{': c.braces++; external = 0; continue;
        case '}': c.braces--; external = 0; continue;
        case '(': c.parens++; continue;
        case ')': c.parens--; continue;
        case ';': external = 0; continue;
        default: break;
        }
        if (c.braces != 0 || c.parens != 0) continue;
        if (is(t, n, ".extern")) external = 1;
        else if (is(t, n, ".global")) {
            int ignored = 1;
            uint64_t bytes = ptx_declaration(&c, external ? &ignored : understood);
            if (!external) total = add(total, bytes);
            external = 0;
        }
    }
    return total;
}

static int looks_like_ptx(const unsigned char *p) {
    for (int i = 0; i < 64 && p[i] != 0; i++)
        if (p[i] >= 0x80 || (p[i] < 0x20 && p[i] != '\n' && p[i] != '\r' && p[i] != '\t'))
            return 0;
    return p[0] != 0;
}

/* ---- ELF (64-bit cubins) ---- */

#define SHT_SYMTAB 2
#define STT_OBJECT 1
#define SHN_COMMON 0xfff2

static int global_section(const unsigned char *elf, uint64_t names_at, uint64_t names_size,
                          const unsigned char *sh) {
    uint32_t name = u32(sh);
    if (name >= names_size) return 0;
    const char *text = (const char *)elf + names_at + name;
    size_t room = (size_t)(names_size - name);
    return strnlen(text, room) < room && strncmp(text, ".nv.global", 10) == 0;
}

/* ptxas leaves `.nv.global` 0 bytes long and gives each variable's size in its symbol only
 * (a 4 GiB array: a 4 GiB OBJECT symbol in an empty NOBITS section), so both are read: per
 * global section the larger of its size and its objects' sizes, plus common objects. */
static uint64_t elf_globals(const unsigned char *elf, uint64_t size, int *understood) {
    if (size < 64 || elf[4] != 2) { *understood = 0; return 0; }   /* ELFCLASS64 only */
    uint64_t shoff = u64(elf + 0x28);
    uint16_t shentsize = u16(elf + 0x3A), shnum = u16(elf + 0x3C), shstrndx = u16(elf + 0x3E);
    if (shentsize < 64 || shstrndx >= shnum || shoff > size ||
        (uint64_t)shnum * shentsize > size - shoff) {
        *understood = 0;
        return 0;
    }
    const unsigned char *names_header = elf + shoff + (uint64_t)shstrndx * shentsize;
    uint64_t names_at = u64(names_header + 24), names_size = u64(names_header + 32);
    if (names_at > size || names_size > size - names_at) { *understood = 0; return 0; }
    uint64_t objects[256] = {0};   /* per section index (cubins have a few dozen) */
    uint64_t total = 0;
    for (uint16_t i = 0; i < shnum; i++) {
        const unsigned char *sh = elf + shoff + (uint64_t)i * shentsize;
        if (u32(sh + 4) != SHT_SYMTAB) continue;
        uint64_t at = u64(sh + 24), bytes = u64(sh + 32), entry = u64(sh + 56);
        if (entry < 24 || at > size || bytes > size - at) { *understood = 0; continue; }
        for (uint64_t sym = at; sym + 24 <= at + bytes; sym += entry) {
            const unsigned char *s = elf + sym;
            if ((s[4] & 0xf) != STT_OBJECT) continue;
            uint16_t section = u16(s + 6);
            uint64_t object = u64(s + 16);
            if (section == SHN_COMMON) total = add(total, object);
            else if (section < shnum && section < 256) objects[section] = add(objects[section], object);
            else if (section < shnum) *understood = 0;
        }
    }
    for (uint16_t i = 0; i < shnum; i++) {
        const unsigned char *sh = elf + shoff + (uint64_t)i * shentsize;
        if (!global_section(elf, names_at, names_size, sh)) continue;
        uint64_t section = u64(sh + 32), held = i < 256 ? objects[i] : 0;
        total = add(total, section > held ? section : held);
    }
    return total;
}

/* The extent of an in-memory ELF whose size nobody gave: the end of its section and program
 * header tables and of every section with file content (the driver reads as far). */
static uint64_t elf_extent(const unsigned char *elf) {
    uint64_t shoff = u64(elf + 0x28), phoff = u64(elf + 0x20);
    uint16_t shentsize = u16(elf + 0x3A), shnum = u16(elf + 0x3C);
    uint64_t end = add(shoff, (uint64_t)shnum * shentsize);
    uint64_t programs = add(phoff, (uint64_t)u16(elf + 0x38) * u16(elf + 0x36));
    if (programs > end) end = programs;
    if (end > MAX_IMAGE || shentsize < 64) return 0;
    for (uint16_t i = 0; i < shnum; i++) {
        const unsigned char *sh = elf + shoff + (uint64_t)i * shentsize;
        if (u32(sh + 4) == 8) continue;   /* SHT_NOBITS: no bytes in the file */
        uint64_t section_end = add(u64(sh + 24), u64(sh + 32));
        if (section_end > end) end = section_end;
    }
    return end > MAX_IMAGE ? 0 : end;
}

/* ---- fatbin ---- */

/* One entry's payload, unpacked. */
static uint64_t entry_globals(uint16_t kind, const unsigned char *data, uint64_t size,
                              int *understood) {
    if (kind == FATBIN_KIND_ELF && size >= 4 && memcmp(data, "\x7f" "ELF", 4) == 0)
        return elf_globals(data, size, understood);
    if (kind == FATBIN_KIND_PTX)
        return ptx_globals((const char *)data, strnlen((const char *)data, (size_t)size),
                           understood);
    *understood = 0;
    return 0;
}

/* A compressed entry: unpacked into a private mapping of the size its header states. */
static uint64_t packed_entry_globals(const unsigned char *entry, const unsigned char *data,
                                     uint64_t payload, int zstd, int *understood) {
    uint64_t packed = u64(entry + 16), size = u64(entry + 56);
    if (packed == 0 || packed > payload || size == 0 || size > MAX_UNPACKED) {
        *understood = 0;
        return 0;
    }
    unsigned char *plain = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (plain == MAP_FAILED) { *understood = 0; return 0; }
    uint64_t total = 0;
    int64_t got = zstd ? gm_zstd_decode(data, (size_t)packed, plain, (size_t)size)
                       : gm_lz4_decode(data, (size_t)packed, plain, (size_t)size);
    if (got != (int64_t)size)
        *understood = 0;
    else
        total = entry_globals(u16(entry), plain, size, understood);
    munmap(plain, (size_t)size);
    return total;
}

/* `limit`: the bytes known to be there (a file's size), or 0 when only the header says. */
static uint64_t fatbin_globals(const unsigned char *fat, uint64_t limit, int *understood) {
    uint16_t header = u16(fat + 6);
    uint64_t size = u64(fat + 8);
    if (header < 16 || size > MAX_IMAGE) { *understood = 0; return 0; }
    uint64_t total = 0, at = header, end = add(header, size);
    if (limit != 0 && end > limit) {
        *understood = 0;
        end = limit;
    }
    while (at + 64 <= end) {
        const unsigned char *entry = fat + at;
        uint32_t entry_header = u32(entry + 4);
        uint64_t payload = u64(entry + 8), flags = u64(entry + 40);
        if (entry_header < 64 || payload > end - at - entry_header) { *understood = 0; break; }
        const unsigned char *data = entry + entry_header;
        if (flags & (FATBIN_FLAG_ZSTD | FATBIN_FLAG_LZ4))
            total = add(total, packed_entry_globals(entry, data, payload,
                                                    (flags & FATBIN_FLAG_ZSTD) != 0, understood));
        else total = add(total, entry_globals(u16(entry), data, payload, understood));
        at += entry_header + payload;
    }
    return total;
}

uint64_t gm_image_globals(const void *image, size_t size_hint, int *understood) {
    *understood = 1;
    const unsigned char *p = image;
    if (p == NULL) { *understood = 0; return 0; }
    if (u32(p) == FATBIN_WRAPPER_MAGIC) {
        const unsigned char *inner;
        memcpy(&inner, p + 8, sizeof inner);
        if (inner == NULL) { *understood = 0; return 0; }
        p = inner;
    }
    if (u32(p) == FATBIN_MAGIC) return fatbin_globals(p, p == image ? size_hint : 0, understood);
    if (memcmp(p, "\x7f" "ELF", 4) == 0) {
        uint64_t size = size_hint ? size_hint : elf_extent(p);
        return elf_globals(p, size, understood);
    }
    if (looks_like_ptx(p)) {
        size_t n = size_hint ? strnlen((const char *)p, size_hint) : strlen((const char *)p);
        return ptx_globals((const char *)p, n, understood);
    }
    *understood = 0;
    return 0;
}

/* A file the driver will load (cuModuleLoad, cuLibraryLoadFromFile), read through a private
 * read-only mapping. */
uint64_t gm_image_file_globals(const char *path, int *understood) {
    *understood = 0;
    if (path == NULL) return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat st;
    uint64_t total = 0;
    if (gm_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= 8 &&
        (uint64_t)st.st_size < MAX_IMAGE) {
        size_t size = (size_t)st.st_size;
        void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map != MAP_FAILED) {
            total = gm_image_globals(map, size, understood);
            munmap(map, size);
        }
    }
    close(fd);
    return total;
}
