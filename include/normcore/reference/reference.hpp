// normcore::reference: every layer by definition, in double. For tests and
// for anyone checking the fast path.
#pragma once

#include "normcore/reference/layer_norm.hpp"
#include "normcore/reference/rms_norm.hpp"
#include "normcore/reference/batch_norm.hpp"
