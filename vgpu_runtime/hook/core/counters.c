/* counters.c: the per-process counters every part of the hook adds to (GM_COUNT); stats.c
 * reads and reports them. Defined apart from both so that counting depends on nothing. */
#include "hook.h"

struct gm_counters gm_counters;
