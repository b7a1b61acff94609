// CPU simulation: cooperative_groups::reduce lives in ../cooperative_groups.h.
#pragma once

#include "../cooperative_groups.h"
