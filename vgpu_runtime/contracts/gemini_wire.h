/*
 * gemini_wire.h: the protocol between the interposer (hook) and the node daemon.
 *
 * This header is the single declaration of the wire format. The C hook includes
 * it; Python reads the part between GM_CDEF_BEGIN and GM_CDEF_END with cffi
 * (vgpu_runtime/contracts/wire.py), so that part must stay in the subset cffi parses:
 * integer #defines, enums, structs of fixed-width integers and arrays.
 *
 * Framing: every frame starts with struct gm_header. `length` counts the whole
 * frame, header included, and is at most GM_MAX_FRAME. Integers are in host
 * byte order: both ends always run on the same machine. A peer that receives
 * a frame with the wrong version, an unknown type or a length that does not
 * match the type's struct treats it as malformed and closes the connection.
 *
 * One persistent connection per process. The daemon knows who is talking from
 * the socket the client connected through (one per allocation) and from
 * SO_PEERCRED; the pid in hello is only for logs.
 *
 * Versions. A connection speaks the version of its hello, in every header both ways; the
 * daemon serves GM_WIRE_VERSION_MIN to GM_WIRE_VERSION, so hooks already running in pods keep
 * working across a daemon upgrade. Only the hello reply has ever changed its layout; every other
 * frame is laid out as in version 1.
 * - Version 1: struct gm_hello_reply_v1. No page descriptors: the hook asks over the socket for
 *   every launch (the daemon takes its requests as its activity).
 * - Version 2: struct gm_hello_reply_v2 adds
 *   - the allocation's pages, passed with SCM_RIGHTS on the reply's first byte (page_fds
 *     descriptors: for each GPU in order its token page, open O_RDONLY, then its activity page,
 *     open O_RDWR). The pages live in the daemon's state directory, never in the channel: the
 *     container needs no write access to anything, and nobody can open them by path;
 *   - the enforcement settings (struct gm_settings), set per node in the daemon's
 *     configuration. The hook's environment may only ask for more safety than these.
 * - Version 3: struct gm_hello_reply drops limit_ppm from each GPU's grant (the
 *   daemon enforces the cap; no hook read it). Its place is `reserved`, zero, which the hook
 *   checks, so the reply keeps version 2's size and alignment with no implicit padding. Version-1
 *   and version-2 hooks still get limit_ppm (the daemon's effective cap) in their own layouts.
 * - Version 4 (this one): the usage report's `reserved` becomes `bursts`, the synchronisation-
 *   delimited bursts merged into the report (the daemon's measure of a tenant's progress: its
 *   bursts per second held, alone and beside others). Same layout; in versions 1 to 3 it is
 *   zero, which the daemon checks, so the hook sends it zero on an older connection.
 * The hook reads memory_limit and share_ppm (its fallback when no grant is to be had,
 * launch/token.c), the pages and the settings.
 *
 * Rollback: a daemon refuses a hello of a version it does not serve with GM_ERR_BAD_VERSION in an
 * error frame of its own (newest) version, then closes. The hook takes that frame's version as
 * the daemon's, says so once, and speaks it on a new connection (every later connection tries
 * GM_WIRE_VERSION first). With a version-1 daemon it opens the pages from the channel.
 */
#ifndef GEMINI_WIRE_H
#define GEMINI_WIRE_H

#include <stdint.h>

/* Where a hook finds its daemon: in a pod the channel directory is mounted at
 * GM_POD_CHANNEL_DIR (a socket there wins over GEMINI_CHANNEL_DIR, which only gemini-run
 * sets), and the daemon's socket in it is GM_CHANNEL_SOCKET_NAME. The one definition:
 * vgpu_runtime/contracts/paths.py reads these two lines (cffi takes no string constants). */
#define GM_POD_CHANNEL_DIR "/run/gemini"
#define GM_CHANNEL_SOCKET_NAME "sched.sock"

/* GM_CDEF_BEGIN */
#define GM_WIRE_VERSION 4
#define GM_WIRE_VERSION_MIN 1   /* the oldest hello the daemon still serves */
#define GM_WIRE_BURSTS_SINCE 4  /* the usage report's bursts; zero (reserved) before */
#define GM_MAX_FRAME 4096
#define GM_MAX_GPUS 16
#define GM_UUID_BYTES 16
#define GM_ALLOCATION_ID_BYTES 32
#define GM_REASON_BYTES 96
#define GM_PPM 1000000

enum gm_msg_type {
    GM_MSG_HELLO = 1,         /* hook -> daemon; answered by HELLO_REPLY */
    GM_MSG_HELLO_REPLY = 2,
    GM_MSG_MEM_RESERVE = 3,   /* hook -> daemon: ask before allocating; answered by MEM_REPLY */
    GM_MSG_MEM_RELEASE = 4,   /* hook -> daemon: freed; answered by MEM_REPLY */
    GM_MSG_MEM_SET = 5,       /* hook -> daemon: absolute amount held of one kind (pools, graphs,
                                 context, and re-declaration after reconnect); answered by MEM_REPLY */
    GM_MSG_MEM_REPLY = 6,
    /* 16..31: GPU-time tokens. */
    GM_MSG_TOKEN_REQUEST = 16,
    GM_MSG_TOKEN_GRANT = 17,
    GM_MSG_TOKEN_RELEASE = 18,
    GM_MSG_USAGE_REPORT = 19,
    GM_MSG_ERROR = 255        /* daemon -> hook, then the daemon closes */
};

enum gm_status {
    GM_OK = 0,
    GM_ERR_OVER_LIMIT = 1,     /* the reservation would pass the memory limit */
    GM_ERR_BAD_VERSION = 2,
    GM_ERR_BAD_GPU = 3,        /* gpu index outside the allocation */
    GM_ERR_MALFORMED = 4,
    GM_ERR_NO_ALLOCATION = 5,  /* the allocation behind this channel is gone */
    GM_ERR_NOT_READY = 6,      /* hello not yet exchanged */
    GM_ERR_UNSUPPORTED = 7     /* a known type this daemon does not serve */
};

/* What the memory is, so the daemon can report it; every kind counts against one limit. */
enum gm_mem_kind {
    GM_MEM_DEVICE = 1,    /* cuMemAlloc*, cuMemAllocPitch */
    GM_MEM_MANAGED = 2,   /* cuMemAllocManaged */
    GM_MEM_ARRAY = 3,     /* cuArray*Create, cuMipmappedArrayCreate */
    GM_MEM_VMM = 4,       /* cuMemCreate */
    GM_MEM_POOL = 5,      /* what stream-ordered pools hold (absolute, via MEM_SET) */
    GM_MEM_GRAPH = 6,     /* graph memory nodes (absolute, via MEM_SET) */
    GM_MEM_CONTEXT = 7,   /* what a context costs (absolute, via MEM_SET) */
    GM_MEM_KIND_COUNT = 8
};

struct gm_header {
    uint32_t length;      /* whole frame, header included */
    uint16_t type;        /* enum gm_msg_type */
    uint16_t version;     /* GM_WIRE_VERSION */
    uint32_t seq;         /* chosen by the requester; a reply echoes it */
    uint32_t reserved;    /* zero */
};

struct gm_hello {
    struct gm_header h;
    uint32_t proto_version;   /* GM_WIRE_VERSION the hook speaks */
    uint32_t pid;             /* for logs only: identity comes from the socket */
    uint64_t flags;           /* zero for now */
};

struct gm_gpu_grant {
    uint8_t uuid[16];         /* GM_UUID_BYTES, as cuDeviceGetUuid returns it */
    uint64_t memory_limit;    /* bytes, for the whole container on this GPU */
    uint32_t share_ppm;       /* guaranteed share of GPU time, parts per million */
    uint32_t reserved;        /* zero (limit_ppm's place in versions 1 and 2) */
};

/* A GPU's grant in versions 1 and 2, which the daemon still sends to those hooks. */
struct gm_gpu_grant_v2 {
    uint8_t uuid[16];
    uint64_t memory_limit;
    uint32_t share_ppm;
    uint32_t limit_ppm;       /* cap on the share, parts per million; no hook reads it */
};

/* Enforcement settings of the node (the daemon's configuration). Where the hook's environment
 * names one too, the hook takes whichever is safer: the longer token timeout, the shorter
 * fallback retry, the longer I/O timeout, the larger context charges. */
struct gm_settings {
    int64_t token_timeout_ns;     /* wait this long for a grant before the fallback */
    int64_t fallback_retry_ns;    /* in the fallback, ask the daemon again after this long */
    int64_t io_timeout_ns;        /* send and receive timeout on the socket */
    uint64_t context_bytes;       /* charged for a context whose cost cannot be measured */
    uint64_t context_max_bytes;   /* the most one measured context is charged */
};

struct gm_hello_reply {
    struct gm_header h;
    uint32_t status;                  /* enum gm_status */
    uint32_t gpu_count;               /* valid entries in gpus[] */
    char allocation_id[32];           /* GM_ALLOCATION_ID_BYTES, NUL-padded */
    struct gm_gpu_grant gpus[16];     /* GM_MAX_GPUS */
    uint32_t page_fds;                /* descriptors passed with this reply: 2 per GPU, or 0 */
    uint32_t reserved;
    struct gm_settings settings;
};

/* The version-2 hello reply, which the daemon still sends to version-2 hooks. */
struct gm_hello_reply_v2 {
    struct gm_header h;
    uint32_t status;
    uint32_t gpu_count;
    char allocation_id[32];
    struct gm_gpu_grant_v2 gpus[16];
    uint32_t page_fds;
    uint32_t reserved;
    struct gm_settings settings;
};

/* The version-1 hello reply, which the daemon still sends to version-1 hooks. */
struct gm_hello_reply_v1 {
    struct gm_header h;
    uint32_t status;
    uint32_t gpu_count;
    char allocation_id[32];
    struct gm_gpu_grant_v2 gpus[16];
};

/* RESERVE and RELEASE carry a delta; SET carries the absolute amount this
 * process holds of `kind` on `gpu`. */
struct gm_mem_request {
    struct gm_header h;
    uint32_t gpu;             /* index into hello_reply.gpus */
    uint32_t kind;            /* enum gm_mem_kind */
    uint64_t bytes;
};

struct gm_mem_reply {
    struct gm_header h;
    uint32_t status;          /* GM_OK or GM_ERR_OVER_LIMIT (the request was not applied) */
    uint32_t gpu;
    uint64_t used;            /* container-wide use on this GPU after the request */
    uint64_t limit;           /* container-wide limit on this GPU */
};

struct gm_error {
    struct gm_header h;
    uint32_t status;          /* enum gm_status */
    uint32_t reserved;
    char reason[96];          /* GM_REASON_BYTES, NUL-terminated */
};
/*
 * GPU-time tokens. One token per GPU; the holder is a container (all its
 * processes). The daemon publishes the grant in a shared page per allocation and GPU (the
 * token page, passed to the hook read-only with the hello reply): a launch checks
 * `now < valid_until_ns` (CLOCK_MONOTONIC) with one atomic load and a vDSO clock read.
 * Only when that fails does the hook send TOKEN_REQUEST and block on the socket for the
 * TOKEN_GRANT. Hooks write their activity to the activity page (passed writable), so the
 * daemon can take the token back from an idle holder without any message on the launch path.
 * All times are CLOCK_MONOTONIC nanoseconds; -1 means unknown.
 */
#define GM_TOKEN_PAGE_MAGIC 1196250187
#define GM_ACTIVITY_PAGE_MAGIC 1196245321
#define GM_PAGE_BYTES 4096

enum gm_gate {
    GM_GATE_OPEN = 0,       /* no token needed: the GPU is this container's alone */
    GM_GATE_TOKEN = 1       /* launches need a valid token */
};

struct gm_token_page {      /* written by the daemon only */
    uint32_t magic;         /* GM_TOKEN_PAGE_MAGIC */
    uint32_t version;       /* GM_WIRE_VERSION */
    uint32_t gate;          /* enum gm_gate */
    uint32_t reserved;
    uint64_t generation;    /* grant counter; changes with every grant */
    int64_t valid_until_ns; /* launches may start while now < valid_until_ns */
};

struct gm_activity_page {   /* written by the hooks of the allocation */
    uint32_t magic;         /* GM_ACTIVITY_PAGE_MAGIC */
    uint32_t version;
    int64_t last_launch_ns; /* the latest launch by any process of the allocation */
    int64_t last_sync_ns;   /* the latest host synchronisation that returned */
    uint64_t launches;
    int64_t fallback_ns;    /* the container's self-gating clock while no grant is to be had
                               (launch/token.c); the daemon only initialises it (0) */
};

enum gm_token_flags {
    /* Work this process had queued when it last asked is still running (GEMINI_HOOK_DRAIN=
     * report, which does not wait for it): work_end_ns is -1, and the daemon charges the time
     * since the release before that ask, when others held the token but this process's work
     * still ran, up to now. The request after the last such one reports the work's end, and
     * is charged from the same point. Daemons older than this flag refuse it as malformed; the
 * hook then reconnects and asks again at once without flags, and sends none after that. */
    GM_TOKEN_WORK_RUNNING = 1
};

struct gm_token_request {
    struct gm_header h;
    uint32_t gpu;
    uint32_t flags;         /* enum gm_token_flags; other bits zero */
    int64_t burst_ns;       /* the hook's estimate of its kernel burst, or -1 */
    int64_t work_end_ns;    /* when the work of its previous grant finished, or -1 */
};

struct gm_token_grant {
    struct gm_header h;
    uint32_t gpu;
    uint32_t status;        /* GM_OK */
    uint64_t generation;
    int64_t valid_until_ns;
};

struct gm_token_release {  /* the holder gives the token back early; no reply */
    struct gm_header h;
    uint32_t gpu;
    uint32_t reserved;
    int64_t work_end_ns;
};

struct gm_usage_report {   /* observed kernel bursts (merged), for quota sizing; no reply */
    struct gm_header h;
    uint32_t gpu;
    uint32_t bursts;        /* the bursts merged into this one, at least 1 (0 before version 4) */
    int64_t burst_start_ns;
    int64_t burst_end_ns;
};
/* GM_CDEF_END */

#endif /* GEMINI_WIRE_H */
